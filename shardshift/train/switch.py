"""Switch training to another layout in the running processes, without a checkpoint: the next
layout's `TrainingState` is built from the current one, which the switch consumes.

Preparing (`prepare_switch`, which may run steps ahead while training goes on), every rank:

1. plans the switch from the trainer's assignment to the new layout (pure: `reshard.plan`), which
   refuses an invalid layout before anything changes;
2. builds the new layout's meshes, its model (TP plan, FSDP2) and its AdamW moments, every
   tensor with its storage shrunk to zero bytes: the structure, and none of the memory.

Switching, at a step boundary (no gradients, no activations), every rank:

3. runs the schedule (`reshard.execute`): each new piece gets its bytes back when the schedule
   first writes it and is filled from local copies and messages; each old piece is freed as soon
   as the schedule is done with it;
4. builds the optimizer over the new parameters with the moved AdamW state, and the new state with
   the moved step, data position and RNG (the trainer then builds the pipeline and the DDP wrapper
   where the layout needs them).

The old state is lost from the first freed byte: after the switch, or after a failure half-way
(a lost peer, a timeout), it is marked so and refuses to be used.

Storage is given and taken back by resizing it (the way FSDP2 frees its unsharded parameters):
this is how memory stays within max(old state, new state) + the budget while a switch runs, with
no tensor constructed while training stands still.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardshift.comm.p2p import Deadline, Transport
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.reshard.execute import PHASES, ExecStats, SwitchProgram, compile_program, run_program
from shardshift.reshard.plan import Assignment, TransitionPlan, plan_transition
from shardshift.reshard.schedule import DEFAULT_BUDGET, SwitchSchedule, build_schedule
from shardshift.reshard.training import MOMENTS, PROGRESS_KEY, RNG_KEY, TrainingSpace
from shardshift.train.config import TrainConfig
from shardshift.train.optim import build_optimizer
from shardshift.train.parallelize import (
    Parallel,
    build_parallel,
    build_stage_skeleton,
    forget_old_meshes,
    materialize,
    shared_parameters,
    tie,
    untie,
)
from shardshift.train.state import Progress, TrainingState, local


@dataclasses.dataclass(frozen=True)
class SwitchReport:
    """One switch, as every rank saw it (byte and memory figures: the worst rank where per rank)."""

    step: int  # the first step run under the new layout (1-based, as in the logs)
    old: str
    new: str  # the new layout, with its rank order when it is not the identity
    seconds: float  # the switch call, until the trainer is ready for its next step (slowest rank)
    move_seconds: float  # of which running the schedule: every round's transfers and copies (slowest rank)
    prepare_seconds: float  # planning and building meshes and model structure (slowest rank)
    prepared_ahead: bool  # whether that was done before the call (then `seconds` excludes it)
    bytes_moved: int  # over all ranks
    bytes_kept: int  # copied locally, over all ranks
    bytes_handed_over: int  # of which kept whole, the memory passed on with no copy (`reshard.execute`)
    bytes_lower_bound: int  # bytes that must move for the chosen assignment
    bytes_total: int  # all state under the new layout, replicas counted
    max_bytes_received: int  # the most any rank received: what bounds the switch's time
    rounds: int
    budget: int
    peak_mem_bytes: int  # the most state + buffers any rank held during the switch
    extra_mem_bytes: int  # the most any rank held beyond max(its old state, its new state)
    device_peak_bytes: int | None = None  # on CUDA: the caching allocator's peak, worst rank
    # Of `move_seconds`, the seconds in each phase of the rounds (`reshard.execute.PHASES`), each the
    # slowest rank's in that phase (so they need not add up to `move_seconds`).
    move_phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # The processor seconds every rank's process spent running the schedule, summed over ranks (the
    # threads of its transport included): ÷ `move_seconds`, how many cores the move kept busy.
    move_cpu_seconds: float = 0.0
    # The page faults every rank's process took while it ran the schedule, summed over ranks: on CPU,
    # pages of fresh memory (a new piece or buffer the allocator could not give from memory it reuses).
    move_page_faults: int = 0

    def event(self) -> dict:
        return {
            "event": "switch",
            "step": self.step,
            "from": self.old,
            "to": self.new,
            "seconds": self.seconds,
            "move_seconds": self.move_seconds,
            "prepare_seconds": self.prepare_seconds,
            "prepared_ahead": self.prepared_ahead,
            "bytes_moved": self.bytes_moved,
            "bytes_kept": self.bytes_kept,
            "bytes_handed_over": self.bytes_handed_over,
            "bytes_lower_bound": self.bytes_lower_bound,
            "bytes_total": self.bytes_total,
            "max_bytes_received": self.max_bytes_received,
            "rounds": self.rounds,
            "budget": self.budget,
            "peak_mem_bytes": self.peak_mem_bytes,
            "extra_mem_bytes": self.extra_mem_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "move_phases": self.move_phases,
            "move_cpu_seconds": self.move_cpu_seconds,
            "move_page_faults": self.move_page_faults,
        }


class _StateSource:
    """The old state's local pieces, by logical tensor (`TrainingState.tensors()`); and, through
    `copies(of, key)`, the copies this process keeps of lost processes' pieces (`--redundancy`)."""

    def __init__(self, state: TrainingState, space: TrainingSpace, copies=None, keep: bool = False):
        self.tensors = space.tensors
        self.held = state.tensors()
        self.pieces: dict[int, torch.Tensor] = {}
        self.copies = copies
        self.keep = keep  # free nothing: the state stays whole until the switch is over

    def local(self, index: int, copy_of: int | None = None) -> torch.Tensor:
        if copy_of is not None:
            return self.copies(copy_of, self.tensors[index].key)
        piece = self.pieces.get(index)
        if piece is None:
            piece = self.pieces[index] = local(self.held[self.tensors[index].key])
        return piece

    def release(self, index: int) -> None:
        if not self.keep and self.tensors[index].kind in ("param", *MOMENTS):
            # The old model and optimizer are dropped after the switch; free the bytes now. A
            # storage shared with numpy cannot shrink: it is freed with the old model instead.
            storage = self.local(index).untyped_storage()
            if storage.resizable():
                storage.resize_(0)


class _ModelSink:
    """The new model's parameters and AdamW state, built with no bytes behind them.

    Built while the switch is prepared: every tensor the new layout needs (DTensor and FSDP2
    wrappers included) is created there, and its storage shrunk to zero bytes straight away. The
    switch then only gives a storage its bytes back when the schedule first writes the piece, so
    memory grows as the schedule allows and no tensor is constructed while training stands still.
    """

    def __init__(self, model: nn.Module, space: TrainingSpace, device: torch.device):
        self.optim_state: dict[str, dict[str, torch.Tensor]] = {}
        self.scalars = {PROGRESS_KEY: torch.zeros(2, dtype=torch.int64), RNG_KEY: torch.empty_like(torch.get_rng_state())}
        self.pieces: dict[int, tuple[torch.Tensor, int]] = {}  # tensor -> (local piece, its bytes)
        index = {t.key: i for i, t in enumerate(space.tensors)}
        for key, tensor in self.scalars.items():
            self.pieces[index[key]] = (tensor, 0)  # 0: kept, never freed
        shared = shared_parameters(model)  # tied weights: allocated once, under the name the space lists
        untie(model, shared)
        for module_name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            materialize(module, device)  # one module's parameters allocated at a time, then freed
            for leaf, param in module.named_parameters(recurse=False):
                fqn = f"{module_name}.{leaf}" if module_name else leaf
                self._reserve(index[f"param:{fqn}"], local(param))
                # AdamW keeps `step` as a 0-d float32 tensor on the CPU, the moments like the parameter.
                state = {"step": torch.zeros((), dtype=torch.float32)}
                for kind in MOMENTS:
                    state[kind] = torch.empty_like(param)
                    self._reserve(index[f"{kind}:{fqn}"], local(state[kind]))
                self.pieces[index[f"step:{fqn}"]] = (state["step"], 0)
                self.optim_state[fqn] = state
        tie(model, shared)

    def _reserve(self, index: int, piece: torch.Tensor) -> None:
        storage = piece.untyped_storage()
        if storage.nbytes() != piece.numel() * piece.element_size():
            raise AssertionError(f"tensor {index}: its piece does not own its storage; it cannot be freed alone")
        self.pieces[index] = (piece, storage.nbytes())
        storage.resize_(0)

    def open(self, index: int) -> torch.Tensor:
        piece, nbytes = self.pieces[index]
        if nbytes:
            piece.untyped_storage().resize_(nbytes)
        return piece


@dataclasses.dataclass
class PreparedSwitch:
    """Everything a switch needs that moves no state: built ahead, while training goes on."""

    cfg: TrainConfig  # the run's configuration under the new layout
    plan: TransitionPlan
    schedule: SwitchSchedule
    par: Parallel  # the new layout's meshes
    model: nn.Module  # its model, parallelized, every tensor of it with no storage yet
    space: TrainingSpace
    sink: _ModelSink  # that model's parameters and AdamW state, by logical tensor
    program: SwitchProgram  # this rank's part of the schedule, every slice worked out
    seconds: float  # time it took to prepare, on this rank


def prepare_switch(cfg: TrainConfig, state: TrainingState, rank: int, layout: Layout,
                   budget: int = DEFAULT_BUDGET) -> PreparedSwitch:
    """Plan a switch of a run under `cfg` with `state` to `layout`; build its meshes, its model and
    AdamW tensors with no storage behind them, and this rank's program of the schedule.

    A collective (the meshes' groups): every rank calls it with the same arguments. Raises
    ValueError, before anything is built, for a layout the model, batch or world cannot take.
    """
    start = time.perf_counter()
    new_cfg = cfg.with_layout(layout)  # refuses a batch the new layout cannot split
    space = state_space(new_cfg.model, new_cfg.param_dtype)
    plan = plan_transition(space, Assignment(cfg.layout, state.par.ranks), layout)
    schedule = build_schedule(plan, budget)
    par = build_parallel(layout, rank, state.par.device.type, plan.new.ranks, state.par.trees)
    model = build_stage_skeleton(new_cfg.model, par, new_cfg.param_dtype, new_cfg.mixed_precision)
    sink = _ModelSink(model, space, par.device)
    program = compile_program(schedule, rank)
    return PreparedSwitch(new_cfg, plan, schedule, par, model, space, sink, program, time.perf_counter() - start)


def switch_state(old: TrainingState, prepared: PreparedSwitch, group, timeout_s: float) -> tuple[TrainingState, ExecStats]:
    """Move `old` into the layout `prepared` was made for (a collective over `group`, which carries
    the transfers, each done within `timeout_s`); return the new state and what the executor did.

    `old` is consumed: it is marked lost when this returns, and also when it raises half-way (a
    `TransferError` naming the peer and round), since some of its storage may be freed by then.
    """
    plan, sink = prepared.plan, prepared.sink
    source = _StateSource(old, prepared.space)
    try:
        stats = run_program(prepared.program, source, sink, Transport(group), Deadline.after(timeout_s),
                            prepared.par.device)
    except BaseException as err:
        old.mark_lost(f"a switch from {plan.old} to {plan.new} failed while moving it ({err}); resume "
                      "from the newest checkpoint")
        raise
    old.mark_lost(f"a switch moved it to {plan.new}; use the state the switch returned")
    optimizer = build_optimizer(prepared.model, prepared.cfg.optim, sink.optim_state)
    new = TrainingState(prepared.par, prepared.model, optimizer, Progress())
    new.restore(sink.scalars)
    return new, stats


class _Nothing:
    """The source of a process that arrives with no state, the sink of one that leaves."""

    def local(self, index: int, copy_of: int | None = None) -> torch.Tensor:
        raise AssertionError(f"tensor {index}: this process holds nothing of the old state")

    def release(self, index: int) -> None:
        raise AssertionError(f"tensor {index}: this process holds nothing of the old state")

    def open(self, index: int) -> torch.Tensor:
        raise AssertionError(f"tensor {index}: this process takes nothing of the new state")


def warm_up(cfg: TrainConfig, par: Parallel | None, device_type: str = "cpu") -> float:
    """Build, and throw away, the structure a change of world builds (a model skeleton, FSDP2 and
    DTensor wrappers, its storage-less sink): a process's first build pays for lazy imports and
    cold code paths (several times what a later build costs), which would otherwise fall in the
    pause of its first change. Returns the seconds it took.

    `par`: the meshes of the world this process is in (its layout's own paths are warmed), or None
    for a process in no world (a joiner waiting to be admitted): it then forms a world of its own
    of one process (a private store), shards the skeleton with FSDP2 over a one-rank mesh, and
    leaves it again."""
    start = time.perf_counter()
    space = state_space(cfg.model, cfg.param_dtype)
    if par is not None:
        _ModelSink(build_stage_skeleton(cfg.model, par, cfg.param_dtype, cfg.mixed_precision), space, par.device)
        return time.perf_counter() - start
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        alone = build_parallel(Layout(), 0, device_type)
        model = build_stage_skeleton(cfg.model, alone, cfg.param_dtype, cfg.mixed_precision)
        mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("fsdp",))
        for layer in model.get_submodule(cfg.model.pipeline.layers).values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _ModelSink(model, space, alone.device)
    finally:
        dist.destroy_process_group()
        forget_old_meshes()
    return time.perf_counter() - start


def switch_world(old: TrainingState | None, plan: TransitionPlan, program: SwitchProgram, new_cfg: TrainConfig,
                 new_par: Parallel | None, group, timeout_s: float, copies=None,
                 keep_old: bool = False) -> tuple[TrainingState | None, ExecStats]:
    """Move the state into a world of another size: `plan` places the old and the new world on
    their processes together (`reshard.plan`), and `program` is this process's part of its
    schedule (`reshard.execute.compile_program`: planned ahead, maybe, while training went on).

    `old`: this process's state (None: it joins with nothing). `new_par`: its meshes in the new
    world (None: it leaves, and returns None). `group` holds every process of the plan and carries
    the transfers. `copies(of, key)`: the copy this process keeps of lost process `of`'s piece of
    logical tensor `key`, for a plan that takes pieces from copies. The new model and AdamW state
    are built with no storage and filled as `switch_state` fills them; `old` is consumed as there,
    unless `keep_old`: then it stays whole, and usable if the move fails (the caller drops it once
    the new world is sure).
    """
    space = state_space(new_cfg.model, new_cfg.param_dtype)
    sink = model = None
    if new_par is not None:
        model = build_stage_skeleton(new_cfg.model, new_par, new_cfg.param_dtype, new_cfg.mixed_precision)
        sink = _ModelSink(model, space, new_par.device)
    device = new_par.device if new_par is not None else old.par.device
    source = _StateSource(old, space, copies, keep=keep_old) if old is not None else _Nothing()
    try:
        stats = run_program(program, source, sink or _Nothing(), Transport(group), Deadline.after(timeout_s), device)
    except BaseException as err:
        if old is not None and not keep_old:
            old.mark_lost(f"a change of world from {plan.old} to {plan.new} failed while moving it ({err})")
        raise
    if old is not None and not keep_old:
        old.mark_lost(f"a change of world moved it to {plan.new}; use the state it returned")
    if new_par is None:
        return None, stats
    new = TrainingState(new_par, model, build_optimizer(model, new_cfg.optim, sink.optim_state), Progress())
    new.restore(sink.scalars)
    return new, stats


def switch_report(prepared: PreparedSwitch, stats: ExecStats, seconds: float, ahead: bool, step: int,
                  group) -> SwitchReport:
    """What a switch did (a collective over `group`: the per-rank figures are the worst rank's).
    `seconds`: the switch call on this rank, until ready to step; `ahead`: it was prepared before
    the call (then `seconds` excludes preparing); `step`: the first step under the new layout."""
    plan, device = prepared.plan, prepared.par.device
    on_cuda = device.type == "cuda"
    extra = stats.peak_bytes - max(stats.old_bytes, stats.new_bytes)
    device_peak = torch.cuda.max_memory_allocated() if on_cuda else 0
    figures = [stats.peak_bytes, extra, stats.bytes_received, device_peak, int(seconds * 1e9),
               int(prepared.seconds * 1e9), int(stats.seconds * 1e9)]
    figures += [int(stats.phases.get(name, 0.0) * 1e9) for name in PHASES]
    worst = torch.tensor(figures, dtype=torch.int64, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([worst], options).wait()  # any group with torch's methods, as the transport takes
    worst = worst.tolist()
    summed = torch.tensor([stats.bytes_handed_over, int(stats.cpu_seconds * 1e9), stats.page_faults],
                          dtype=torch.int64, device=device)
    group.allreduce([summed]).wait()
    handed, cpu_ns, faults = summed.tolist()
    return SwitchReport(
        step=step,
        old=str(plan.old),
        new=str(plan.new),
        seconds=worst[4] / 1e9,
        move_seconds=worst[6] / 1e9,
        prepare_seconds=worst[5] / 1e9,
        prepared_ahead=ahead,
        bytes_moved=plan.bytes_moved,
        bytes_kept=plan.bytes_kept,
        bytes_handed_over=handed,
        bytes_lower_bound=plan.bytes_lower_bound,
        bytes_total=plan.bytes_total,
        max_bytes_received=worst[2],
        rounds=stats.rounds,
        budget=prepared.schedule.budget,
        peak_mem_bytes=worst[0],
        extra_mem_bytes=worst[1],
        device_peak_bytes=worst[3] if on_cuda else None,
        move_phases={name: ns / 1e9 for name, ns in zip(PHASES, worst[7:])},
        move_cpu_seconds=cpu_ns / 1e9,
        move_page_faults=faults,
    )
