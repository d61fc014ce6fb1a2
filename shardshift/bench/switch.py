"""`shardshift bench switch`: a layout switch four ways, measured side by side in the same run, one
transition at a time.

    shardshift bench switch --nproc 4 --suite                  # the default chain, model base
    shardshift bench switch --nproc 4 --model tiny --from dp=4 --to fsdp=2,tp=2
    shardshift bench switch --nproc 2 --model test --suite 'dp=2;fsdp=2;pp=2' --json

One trainer walks a chain of layouts L0 → L1 → … on the bench's processes. It takes one step under
L0 first, so AdamW state exists. For each transition A → B, at a step boundary, in this order:

1. **Link rate.** Every rank posts, at once, an ``isend`` of `p2p_bytes` to every other rank and an
   ``irecv`` of as much from every other rank, on the job's default group, then waits on all: the
   concurrent all-pairs pattern a switch round uses. The rate is the bytes one rank receives
   ((n-1) × `p2p_bytes`) ÷ the slowest rank's time; the best of `p2p_reps` timed runs after one
   warm-up (the limit's), and their median (the model's, with ``predict``).
2. **DCP save** (``dcp_save_seconds``): `checkpoint.write` of the trainer under A (PyTorch's
   ``dcp.save``) into a temporary directory on local disk, barrier to barrier. Then
   `checkpoint.publish` makes it a checkpoint the restart can resume from (the manifest's CRC-32s,
   the rename: ``seal_seconds``, not counted: the baseline is DCP's own save).
3. **Restart** (``restart_seconds``, rank 0 only; skipped with `restart=False`): rank 0 starts
   ``python -m shardshift train --nproc N --layout B --resume DIR --stop-at step+1`` (the local
   launcher: N fresh worker processes, fresh imports, a fresh process group, a trainer built under
   B, DCP load) and reads its output. The other ranks wait in a barrier, blocked in gloo, not
   spinning, so the fresh job has the cores. ``restart_seconds`` = the DCP save of step 2 + the time
   from spawning the job until its rank 0 *starts* its first step (the moment its first step's line
   appears, less that step's own ``step_time_s`` from the job's metrics file): the time until training
   resumes, as for the switch. The first step itself is ``restart_step_seconds``; the job's whole
   life, exit included, is ``restart_job_seconds``. A job that fails is reported
   (``restart_error``, its output on stderr) and the bench goes on: the failure is a finding about
   the baseline, not about the switch.
4. **DCP load** (``dcp_load_seconds``): a fresh trainer is built under B with the rank order the
   switch will choose (the same pure plan; ``dcp_build_seconds``, not counted: the switch's column
   includes building its own model, but a DCP resume could build its model on the meta device and
   skip the random initialisation a `Trainer` does), then `checkpoint.load` fills it, barrier to
   barrier. A digest of each of its tensors is kept and the trainer is dropped, so the bench never
   holds two copies of B's state (the checkpoint is deleted too).
5. **Online switch** (``switch_seconds``): `Trainer.prepare_switch(B, budget)` first (planning,
   building B's meshes, its model and AdamW tensors with no storage behind them, and this rank's
   program of the schedule: ``prepare_seconds``, not counted, as the training loop prepares each
   switch ahead while it trains and as the DCP column does not count building B's trainer), then `Trainer.switch` after a barrier, the slowest rank's
   `SwitchReport.seconds`: moving every byte, allocating the new pieces as they fill, building the
   optimizer, the DDP wrapper or the pipeline schedule; ready for the next step. The switched state is
   compared with the DCP-loaded one, bit for bit (``state_mismatches``: tensors that differ, over
   all ranks, the RNG state counted once per rank; 0 is the only correct value).
6. One training step on the switched trainer (``step_after_seconds``, not part of any column), to
   show that training goes on.

**Repeats.** Each transition is measured `repeat` times (``--repeat``, default 3): steps 1 to 6,
then a switch back to A (not measured) before the next. The ratios are computed per repeat; the
record of the transition holds the median of every figure, with ``*_min`` and ``*_max`` beside
the times, the link rate and the ratios (`SPREAD`); ``spread`` is the farthest any of dcp/sw,
rst/sw and sw/lim strayed from its median, as a fraction. Peak and extra memory are the most of
any repeat, mismatches their sum. Each repeat measures its own link rate, so the limit is always
of the same moment as the switch.

Before a restart every rank hands the memory its allocator keeps free back to the system (glibc's
``malloc_trim``): the restart's fresh processes run beside the bench's own, and freed pieces of
earlier transitions would otherwise count against the machine's memory twice. Nothing is handed
back right before a switch: a running job does not do it either (its steps free gradients and
activations, which its allocator keeps for reuse), and a switch after such a trim would take every
new piece on pages the kernel must first fault in and zero.

With ``predict``, more figures are measured before each switch on the same processes, and make
an α–β model of this machine (`simulate.cluster`: one host of `nproc` GPUs) on which the switch's
own schedule is timed:

- a rank's port: one pair's rate when it exchanges alone (ranks 0 and 1, both ways), as when the
  machine is not shared (on CPU its bytes in and out together, both ends of a transfer being a
  rank's processor work: one rank sending to three takes as long as a pair exchanging); the link
  rate of step 1 times the ranks is what the machine moves at most (the host's bandwidth);
- the per-message cost: a round of 32 tiny messages to and from every peer, ÷ the messages,
  in time and (on CPU) in processor time, the transport's threads included, which the model books
  on the cores beside the copies;
- the rates of a local copy out of the rank's own state (`copy_rates`: a few disjoint samples of
  it, each copied once, as the switch copies it) into memory written before, from whole tensors
  and from the first half of every row of its matrices (a strided slice);
- the cost of one piece end beside its bytes (`piece_cost`: the executor itself, `run_program`,
  making many local copies of a small slice, as it does for each part it packs, unpacks or copies);
- on CPU, the kernel's work on pages (`page_rates`): mapping and zeroing fresh pages as a copy
  first writes them, beyond the copy, and taking written pages back when a mapping is released;
  and, where glibc is the allocator, what each rank's allocator holds as the switch starts
  (`heap_state`: its free heap bytes, and the share of its live bytes it mapped apart), from which
  the model replays where each new piece lands and what each freed one hands back
  (`simulate.host_memory`; ``predicted_fresh_bytes`` is to be read beside
  ``move_page_faults`` × the page size).

The copies, the piece cost and the page rates are measured by every rank at once, as the
switch's ranks copy at once (sharing the memory and its caches), and on CPU in the processor time
of the measuring process, so that four ranks on two cores are not charged for waiting for a core: the model gives
every rank's copies to the host's cores (`Cluster.host_cores`), where they take turns with
gloo's transfers. The mean over the ranks is the model's.

Every figure the model is given is the median of its timed runs (the link rate too: the model's
host bandwidth is the median run's, where the limit keeps the best), except the page rates (a
difference of two copies, of which single noisy pairs can give 0: the fastest of each). The model
predicts a typical switch, and it is compared with the median of the repeats; inputs taken at
their best would make every term optimistic at once.

``predicted_seconds`` stands beside ``move_seconds`` (the part of ``switch_seconds`` that runs the
schedule, transfers and copies, the slowest rank's: ``predicted_over_move``) and beside
``switch_seconds`` (``predicted_over_switch``: the rest is building the new layout's optimizer
and wrappers, which the model leaves out). The record keeps what the model was given: the link
rate (``model_link_bytes_per_s``), the per-message cost and its processor time, the lone pair's
rate, the two copy rates and the piece cost, the two page rates, and every rank's free heap bytes
and mapped-apart share (``model_*``).

``dcp_seconds`` = save + load: in-place resharding through the file system, with no process
restart. ``limit_seconds`` = `SwitchReport.max_bytes_received` ÷ the link rate of step 1: no switch
can finish before its busiest receiver has taken its bytes in at the rate the links give when every
pair is busy. Local copies (``bytes_kept``) are not counted in it. Every time is the slowest rank's.

``move_cpu_seconds`` is the processor time every rank's process spent in the switch's rounds,
summed over ranks, its transport's threads included (`SwitchReport.move_cpu_seconds`);
``transfer_cpu_seconds`` what moving ``bytes_moved`` costs at the processor time per byte the link
measurement of step 1 took (``link_cpu_seconds_per_byte``). Where the cores that copy also move
the bytes (gloo on CPU), the difference is the packing, copying and driving the limit leaves out,
and ``move_cpu_seconds`` ÷ ``move_seconds`` close to the machine's ``cores`` says that the move
is bound by them, not by the links. ``move_page_faults`` counts the pages of fresh memory the
ranks touched while moving, summed (`SwitchReport.move_page_faults`): on CPU each is a page the
kernel maps and zeroes, which makes a copy into it several times slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import hashlib
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardshift.bench.restart import RestartFailed, restart_job
from shardshift.comm.p2p import Deadline, PeerOp, Transport
from shardshift.console import say
from shardshift.launch import STORE_ENV
from shardshift.layout import Layout
from shardshift.plots.canvas import check_drawable
from shardshift.reshard.execute import Copy, RoundWork, SwitchProgram, run_program
from shardshift.reshard.plan import plan_transition
from shardshift.runtime import run_in_group
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.data import load_tokens
from shardshift.models.space import state_space
from shardshift.train.state import local
from shardshift.train.trainer import Trainer
from shardshift.units import format_size

_P2P_TAG = 1 << 20  # above any switch round's tag
_DIGEST_CHUNK = 16 << 20  # bytes hashed at a time


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchBenchOptions:
    """What `shardshift bench switch` runs; validated when built (ValueError says what to change)."""

    chain: tuple[Layout, ...]  # the layouts walked, first to last
    cfg: TrainConfig  # the run under chain[0]: one step under it, then one after each switch
    nproc: int
    budget: int  # bytes per switch round (see reshard/schedule.py)
    repeat: int = 3  # measurements of each transition, switching back between them
    p2p_bytes: int  # message size of the link-rate measurement, per ordered pair
    p2p_reps: int = 3  # timed runs of each measurement (the link rate's best is the limit's; the model takes medians)
    restart: bool = True  # measure the checkpoint-and-restart column
    predict: bool = False  # also time each switch's schedule on an alpha-beta model of this machine
    timeout_s: float = 600.0  # the run's collective timeout; the restart job gets 90% of it
    json: bool = False
    plot: Path | None = None  # rank 0 draws the report here (a PNG) once it exists

    def __post_init__(self) -> None:
        from shardshift.reshard.schedule import MIN_BUDGET

        if self.nproc < 2:
            raise ValueError(f"--nproc {self.nproc}: a switch moves state between ranks; give --nproc >= 2")
        if len(self.chain) < 2:
            raise ValueError(f"the chain names {len(self.chain)} layout; a switch needs at least two")
        for a, b in zip(self.chain, self.chain[1:]):
            if a == b:
                raise ValueError(f"the chain switches from {a} to itself; drop the repeated layout")
        if self.repeat < 1:
            raise ValueError(f"--repeat {self.repeat}: measure each transition at least once")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s} must be > 0 seconds")
        if self.budget < MIN_BUDGET:
            raise ValueError(f"--budget is {self.budget} bytes; give at least {MIN_BUDGET} (4K)")
        assert self.cfg.layout == self.chain[0], (self.cfg.layout, self.chain)
        for layout in self.chain:
            layout.check_world(self.nproc)
        for layout in self.chain[1:]:
            self.cfg.with_layout(layout)  # refuses a layout the model or the batch cannot take
        if self.plot is not None:
            check_drawable(self.plot, "--plot")


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, device: torch.device):
    """(fn(), the slowest rank's seconds), all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return result, _max_over_ranks(time.perf_counter() - start, device)


@dataclasses.dataclass(frozen=True)
class LinkRate:
    """What the job's links give when every ordered pair of ranks exchanges at once (`link_rate`)."""

    bytes_per_s: float  # that one rank receives, in the best run: what the links give at most (the limit's)
    typical_bytes_per_s: float  # the same in the median run: what a switch's transfers meet (the model's)
    cpu_seconds_per_byte: float  # processor time of all ranks' processes per byte moved, over the timed runs


def link_rate(nbytes: int, reps: int, device: torch.device, timeout_s: float) -> LinkRate:
    """Every ordered pair exchanges `nbytes` at once, `reps` times after a warm-up: the bytes per
    second one rank receives in the best run and in the median one, and the processor time it cost
    per byte moved."""
    transport = Transport(dist.group.WORLD)
    rank, world = transport.rank, transport.size
    peers = [p for p in range(world) if p != rank]
    send = torch.full((nbytes,), rank, dtype=torch.uint8, device=device)
    inbox = {p: torch.empty(nbytes, dtype=torch.uint8, device=device) for p in peers}
    times, cpu = [], 0.0
    for rep in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        # One round, as a switch posts it: every receive, then every send, before any wait.
        tag = _P2P_TAG + rep
        transport.post_round([PeerOp(p, send, tag) for p in peers], [PeerOp(p, inbox[p], tag) for p in peers],
                             "measuring the link rate").wait(Deadline.after(timeout_s))
        mine, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        seconds = _max_over_ranks(mine, device)
        if rep:
            times.append(seconds)
            cpu += cpu_s
    for p, buf in inbox.items():  # a rate measured on garbage would be no rate
        assert int(buf[0]) == p and int(buf[-1]) == p, f"rank {rank} received wrong bytes from {p}"
    total = torch.tensor([cpu], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    moved = (world - 1) * nbytes
    return LinkRate(moved / min(times), moved / statistics.median(times), float(total) / (reps * world * moved))


def message_cost(reps: int, device: torch.device, timeout_s: float, per_pair: int = 32) -> tuple[float, float]:
    """What one message end costs a rank when many are in flight, as in a switch round: every rank
    posts `per_pair` tiny messages to and from every other at once. Returns the seconds (a round's
    time ÷ the message ends of one rank) and the processor time (of every rank's process, its
    transport's threads included, ÷ every rank's message ends), each the median over the rounds."""
    transport = Transport(dist.group.WORLD)
    peers = [p for p in range(transport.size) if p != transport.rank]
    send = torch.zeros(64, dtype=torch.uint8, device=device)
    inbox = [torch.empty(64, dtype=torch.uint8, device=device) for _ in range(len(peers) * per_pair)]
    times, cpus = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        tags = [_P2P_TAG + (rep * per_pair + k) for k in range(per_pair)]
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        transport.post_round([PeerOp(p, send, tag) for p in peers for tag in tags],
                             [PeerOp(p, buf, tag) for (p, tag), buf in zip(((p, t) for p in peers for t in tags), inbox)],
                             "measuring the per-message cost").wait(Deadline.after(timeout_s))
        seconds, cpu = _max_over_ranks(time.perf_counter() - start, device), time.process_time() - start_cpu
        total = torch.tensor([cpu], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        if rep:
            times.append(seconds)
            cpus.append(float(total))
    ends = 2 * len(peers) * per_pair
    return statistics.median(times) / ends, statistics.median(cpus) / (transport.size * ends)


def pair_rate(nbytes: int, reps: int, device: torch.device, timeout_s: float) -> float:
    """Bytes per second a rank receives when it and one peer are the only ones exchanging (ranks 0
    and 1, both ways; the others wait; the median of `reps` timed runs): what one rank's port gives
    when the machine is not shared."""
    transport = Transport(dist.group.WORLD)
    rank = transport.rank
    peer = {0: 1, 1: 0}.get(rank)
    send = torch.full((nbytes,), rank, dtype=torch.uint8, device=device)
    inbox = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for rep in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        if peer is not None:
            tag = _P2P_TAG + 100 + rep
            transport.post_round([PeerOp(peer, send, tag)], [PeerOp(peer, inbox, tag)],
                                 "measuring one pair's rate").wait(Deadline.after(timeout_s))
        seconds = _max_over_ranks(time.perf_counter() - start, device)
        if rep:
            times.append(seconds)
    return nbytes / statistics.median(times)


def copy_rates(state: Sequence[torch.Tensor], nbytes: int, device: torch.device, samples: int = 3
               ) -> tuple[float, float]:
    """Bytes per second of a local copy out of this rank's own state (`state`: the local tensors it
    holds) into memory written before, contiguous and strided: each the median of `samples`
    disjoint samples of the state, copied once (`_state_samples`), on CPU per second of this
    process's processor time, on CUDA until the device is done. Strided: the first half of every
    row of the state's matrices, as a column slice of a tensor-parallel weight is cut.

    Out of the state, once, because that is what a switch copies: here a buffer made for the
    measurement and copied again and again moved 6.3-6.7 GB/s, while 64 MiB out of a rank's state
    moved 4.3-5.8 GB/s on their first copy (5.8-6.1 on the next). Into memory written
    before: a tensor allocated for the measurement alone gets fresh pages on CPU, which the kernel
    faults in and zeroes during the copy (the model books fresh pages apart, from what the
    allocator holds)."""
    whole, halves = _state_samples(state, nbytes, device, samples)
    return _copy_rate(whole, strided=False), _copy_rate(halves, strided=True)


def _copy_rate(groups: list[list[torch.Tensor]], strided: bool) -> float:
    """The median over `groups` of the rate at which one copy of each group moves into a scratch
    buffer written before (each tensor's part at an offset of its own, 64-byte aligned)."""
    layouts = [_packed(group, strided) for group in groups]
    scratch = torch.zeros(max(end for _, end in layouts), dtype=torch.uint8, device=groups[0][0].device)
    rates = []
    for group, (offsets, _) in zip(groups, layouts):
        parts = [_sampled(t, strided) for t in group]
        targets = [scratch[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                   for p, at in zip(parts, offsets)]
        seconds = _seconds(lambda: [target.copy_(part) for part, target in zip(parts, targets)], scratch.device)
        rates.append(sum(p.numel() * p.element_size() for p in parts) / max(seconds, 1e-9))
    return statistics.median(rates)


def _packed(group: list[torch.Tensor], strided: bool) -> tuple[list[int], int]:
    """Byte offsets, 64-byte aligned, of each tensor's sampled part laid end to end; and the end."""
    offsets, end = [], 0
    for t in group:
        offsets.append(-(-end // 64) * 64)
        end = offsets[-1] + _sampled(t, strided).numel() * t.element_size()
    return offsets, end


def _state_samples(state: Sequence[torch.Tensor], nbytes: int, device: torch.device, samples: int
                   ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Up to `samples` groups of the state's contiguous tensors for each copy rate, every group of
    at least the sample's bytes (or what is left): about `nbytes`, but at most 1/48 of the state,
    so that the samples of both rates together warm no more than an eighth of what the switch
    copies after them. The strided groups hold matrices only, counted by the half rows copied,
    and none of the contiguous groups' tensors. Where the state has nothing to sample, a buffer of
    about `nbytes` (on `device`) stands in for it."""
    usable = [t for t in state if t.is_contiguous() and t.numel() > 0]
    share = max(min(nbytes, sum(t.numel() * t.element_size() for t in usable) // (16 * samples)), 1 << 20)
    kinds: dict[bool, list[list[torch.Tensor]]] = {False: [], True: []}  # contiguous, strided: their groups
    held = dict.fromkeys(kinds, 0)  # bytes in each kind's last group
    for t in usable:
        for strided, groups in kinds.items():  # a tensor goes to one kind: the contiguous samples fill first
            done = len(groups) == samples and held[strided] >= share
            if done or (strided and (t.dim() != 2 or t.shape[1] < 2)):
                continue
            if not groups or held[strided] >= share:
                groups.append([])
                held[strided] = 0
            groups[-1].append(t)
            held[strided] += _sampled(t, strided).numel() * t.element_size()
            break
    stand_in = [[torch.ones((max(1, nbytes // 2048), 2048), dtype=torch.uint8, device=device)]]
    return kinds[False] or stand_in, kinds[True] or stand_in


def _sampled(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """What a copy rate copies of a state tensor: all of it, or the first half of every row."""
    return t[:, : t.shape[1] // 2] if strided else t


def piece_cost(device: torch.device, pieces: int = 2000) -> float:
    """Seconds one piece end costs beside its bytes (`_typical`: on CPU this process's processor
    time), measured through the executor itself: `run_program` making `pieces` local copies of
    a small slice each, every one into a piece of its own, with no message. That is the work the
    executor does for every part it packs, unpacks or copies: looking up the two pieces, cutting
    the slices, dispatching the copy, keeping its account."""
    shape, where = (8, 64), (slice(2, 6), slice(0, 64))
    old = {t: torch.ones(shape, device=device) for t in range(pieces)}
    new = {t: torch.empty(shape, device=device) for t in range(pieces)}
    nbytes = new[0].numel() * new[0].element_size()
    program = SwitchProgram(
        rank=0,
        rounds=(RoundWork(opens=tuple((t, nbytes, shape) for t in range(pieces)), sends=(), recvs=(),
                          copies=tuple(Copy(t, where, where) for t in range(pieces)), closes=()),),
        idle_opens=(), idle_closes=(), old_bytes=pieces * nbytes, new_bytes=pieces * nbytes)
    source = SimpleNamespace(local=lambda t, copy_of=None: old[t], release=lambda t: None)
    sink = SimpleNamespace(open=new.__getitem__)
    transport = SimpleNamespace(post_round=lambda sends, recvs, what: _NoMessages())
    return _typical(lambda: run_program(program, source, sink, transport, Deadline.after(60), device), device) / pieces


def page_rates(nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """On CPU, bytes per second of processor time (this process's) that the kernel takes (1) to
    map and zero fresh pages as a copy first writes them, beyond the copy itself, and (2) to take
    written pages back when their mapping is released, over `repeats` mappings of `nbytes` of
    their own (`mmap`, as glibc maps a large block), each copied into twice (the first copy faults
    every page in; the second, into the same pages, is the copy alone) and then closed: the
    fastest first copy less the fastest second, and the fastest close."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    first = again = unmap = float("inf")  # the fastest of each: a difference of single noisy pairs can be 0
    for _ in range(repeats):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps: not shared
        dst = torch.frombuffer(mapping, dtype=torch.uint8)
        times = []
        for _ in range(2):
            start = time.process_time()
            dst.copy_(src)
            times.append(time.process_time() - start)
        del dst
        start = time.process_time()
        mapping.close()
        unmap = min(unmap, time.process_time() - start)
        first, again = min(first, times[0]), min(again, times[1])
    return nbytes / max(first - again, 1e-9), nbytes / max(unmap, 1e-9)


def heap_state() -> tuple[float, float] | None:
    """(bytes glibc's allocator holds free in its heaps, the share of the bytes in use that it
    mapped apart) for this process, from ``mallinfo2``; None where glibc is not the allocator."""
    name = ctypes.util.find_library("c")
    mallinfo2 = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    live = info.hblkhd + info.uordblks
    return float(info.fordblks), info.hblkhd / live if live else 1.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class _NoMessages:
    """A posted round with no message (`piece_cost`'s program sends nothing)."""

    def received(self, deadline: Deadline):
        return iter(())

    def wait(self, deadline: Deadline) -> None:
        pass


def _typical(run, device: torch.device) -> float:
    """Seconds of the median of three timed calls of `run` after an untimed one (`_seconds`). The
    median, not the fastest: the model predicts a typical switch (it is compared with the median of
    the repeats), and inputs taken at their best make every term optimistic at once."""
    return statistics.median([_seconds(run, device) for _ in range(4)][1:])


def _seconds(run, device: torch.device) -> float:
    """Seconds of one call of `run`: on CUDA the time until the device is done; on CPU the
    processor time of this process (its threads: torch's intra-op ones copy too; the transport's
    are idle meanwhile), so that ranks measuring at once on fewer cores than ranks are not charged
    for the time they wait for one (the switch's model gives each rank's work to the host's cores).
    What the call returns is dropped after its clock stops."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # nothing queued before counts
    start = clock()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = clock() - start
    del result
    return seconds


def _copy_rates(state: Sequence[torch.Tensor], nbytes: int, device: torch.device) -> tuple[float, ...]:
    """The contiguous and strided `copy_rates` out of this rank's `state`, the `piece_cost` and on
    CPU the two `page_rates` (else 0), measured by every rank at once (after a barrier), as the
    switch's ranks copy at once, sharing the memory, its caches and on CPU the cores: the mean over
    the ranks, the same on every rank."""
    dist.barrier()
    pages = page_rates(nbytes) if device.type == "cpu" else (0.0, 0.0)
    rates = torch.tensor([*copy_rates(state, nbytes, device), piece_cost(device), *pages], dtype=torch.float64,
                         device=device)
    dist.all_reduce(rates)
    rates /= dist.get_world_size()
    return tuple(float(rate) for rate in rates)


def _host_memory(device: torch.device):
    """Every rank's `heap_state` (`simulate.host_memory.HostMemory`), or None where a rank's allocator
    is not glibc or the ranks copy on GPUs."""
    from shardshift.simulate.host_memory import HostMemory

    state = heap_state() if device.type == "cpu" else None
    figures = torch.tensor([*(state or (0.0, 0.0)), state is not None], dtype=torch.float64, device=device)
    every = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
    dist.all_gather(every, figures)
    if not all(bool(f[2]) for f in every):
        return None
    return HostMemory(tuple(float(f[0]) for f in every), tuple(float(f[1]) for f in every))


def _cores() -> int:
    """The processors this rank may run on (its affinity), which the machine's ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _predicted(schedule, state: Sequence[torch.Tensor], rate: float, opts: SwitchBenchOptions,
               device: torch.device) -> dict:
    """The switch's schedule timed on an α–β model of this machine, measured now (module
    docstring): ``predicted_seconds`` and the model's measured inputs (``model_*``)."""
    from shardshift.simulate.cluster import Cluster, predict
    from shardshift.simulate.host_memory import PageRates, page_work

    memory = _host_memory(device)  # before the measurements below allocate and free
    alpha, alpha_cpu = message_cost(opts.p2p_reps, device, opts.timeout_s)
    alone = pair_rate(opts.p2p_bytes, opts.p2p_reps, device, opts.timeout_s)
    copies, strided, piece, fresh, unmap = _copy_rates(state, opts.p2p_bytes, device)
    world = dist.get_world_size()
    # On CUDA each GPU copies on its own; on CPU the ranks' copies and messages share the cores with gloo.
    cpu = device.type != "cuda"
    port = 2 * alone if cpu else alone  # a CPU host's rank passes its bytes in and out together
    pages = memory is not None  # the kernel's work on pages, booked where the allocators' state is known
    machine = Cluster(hosts=1, gpus_per_host=world, intra_bandwidth=port, host_bandwidth=world * rate,
                      intra_latency=alpha, nics_per_host=1, nic_bandwidth=rate, latency=alpha, copy_bandwidth=copies,
                      strided_copy_bandwidth=strided, host_cores=_cores() if cpu else 0, piece_seconds=piece,
                      message_host_seconds=alpha_cpu if cpu else 0.0, name="this machine")
    work = page_work(schedule, PageRates(fresh_page_bandwidth=fresh, free_bandwidth=unmap), memory) if pages else None
    prediction = predict(schedule, machine, None if work is None else work.seconds)
    return {"predicted_seconds": prediction.seconds, "model_link_bytes_per_s": rate, "model_message_seconds": alpha,
            "model_message_cpu_seconds": alpha_cpu, "model_pair_bytes_per_s": alone, "model_copy_bytes_per_s": copies,
            "model_strided_copy_bytes_per_s": strided, "model_piece_seconds": piece,
            "model_fresh_page_bytes_per_s": fresh if pages else None,
            "model_free_bytes_per_s": unmap if pages else None,
            "model_heap_free_bytes": list(memory.free_bytes) if pages else None,
            "model_mapped_share": list(memory.mapped_share) if pages else None,
            "predicted_fresh_bytes": work.fresh_bytes if pages else None,
            "predicted_unmapped_bytes": work.unmapped_bytes if pages else None}


def _digests(trainer: Trainer) -> dict[str, bytes]:
    """A digest of every logical tensor this rank holds (dtype, shape, every byte), by key.

    Includes the global RNG state: call it right after a load or a switch.
    """
    # Bytes are hashed through a buffer of our own: `.numpy()` on the state itself would mark its
    # storage not resizable, and a switch frees old state by resizing its storage to zero bytes.
    buf = torch.empty(_DIGEST_CHUNK, dtype=torch.uint8)

    def digest(t: torch.Tensor) -> bytes:
        t = local(t).detach()
        raw = t.reshape(-1).contiguous().view(torch.uint8)
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
        for start in range(0, raw.numel(), _DIGEST_CHUNK):
            piece = raw[start : start + _DIGEST_CHUNK]
            buf[: piece.numel()].copy_(piece)
            h.update(buf[: piece.numel()].numpy())
        return h.digest()

    return {key: digest(tensor) for key, tensor in trainer.state.tensors().items()}


def _mismatches(a: dict[str, bytes], b: dict[str, bytes]) -> int:
    """Names whose digests differ, or that are not in both."""
    return len(set(a) ^ set(b)) + sum(a[key] != b[key] for key in set(a) & set(b))


def _scratch_parent() -> str | None:
    """Where checkpoints go: the local launcher's temporary directory, which it removes when the
    job ends even if a worker was killed (the `finally` below then never runs); else the system's."""
    store = os.environ.get(STORE_ENV)
    return os.path.dirname(store) if store else None


def run_rank(opts: SwitchBenchOptions) -> int:
    """One rank's part of the bench; rank 0 prints the report."""
    proc, records = run_in_group(opts.timeout_s, lambda proc: run_switch_bench(opts, proc.rank, proc.device_type))
    if proc.rank == 0:
        result = report(opts, records, proc.device_type)
        if opts.plot is not None:
            from shardshift.plots.bench import draw_switch_bench

            draw_switch_bench(result, opts.plot)
            say(f"wrote {opts.plot}", "stderr")
    return 0


def run_switch_bench(opts: SwitchBenchOptions, rank: int, device_type: str) -> list[dict]:
    """Walk the chain; one record per transition, complete on rank 0."""
    cfg, chain = opts.cfg, opts.chain
    tokens = load_tokens(cfg.data)
    trainer = Trainer(cfg, rank, device_type, tokens=tokens, timeout_s=opts.timeout_s)
    trainer.train_step()  # AdamW state exists from here on
    root = [tempfile.mkdtemp(prefix="shardshift-bench-switch-", dir=_scratch_parent()) if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    root = Path(root[0])
    try:
        return [_repeated(trainer, after, tokens, root, opts) for after in chain[1:]]
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _repeated(trainer: Trainer, after: Layout, tokens, root: Path, opts: SwitchBenchOptions) -> dict:
    """`opts.repeat` measurements of the switch from the trainer's layout to `after` (switching back
    between them, unmeasured), summarised in one record (`summarise`)."""
    before = trainer.cfg.layout
    records = []
    for repeat in range(opts.repeat):
        if repeat:
            trainer.switch(trainer.prepare_switch(before, opts.budget))
        records.append(_transition(trainer, after, tokens, root, opts))
    return summarise(records)


# Per repeat, then summarised by their median, with the least and the most beside it (``*_min``,
# ``*_max``): the times, the link rate and the ratios of each repeat.
SPREAD = ("switch_seconds", "move_seconds", "dcp_seconds", "dcp_save_seconds", "dcp_load_seconds", "restart_seconds",
          "limit_seconds", "predicted_seconds", "link_bytes_per_s", "dcp_over_switch", "restart_over_switch",
          "switch_over_limit", "predicted_over_switch", "predicted_over_move")
RATIOS = {"dcp_over_switch": ("dcp_seconds", "switch_seconds"),
          "restart_over_switch": ("restart_seconds", "switch_seconds"),
          "switch_over_limit": ("switch_seconds", "limit_seconds"),
          "predicted_over_switch": ("predicted_seconds", "switch_seconds"),
          "predicted_over_move": ("predicted_seconds", "move_seconds")}


def summarise(records: list[dict]) -> dict:
    """One record for the repeats of a transition: every number is their median, except the peak
    and extra memory (the most: the budget bounds every repeat), the mismatches (summed: one is
    too many) and the steps taken before the switch (the first repeat's); the `SPREAD` figures get
    ``*_min`` and ``*_max`` too. A restart that failed in any repeat is reported."""
    out = dict(records[0])
    out["repeats"] = len(records)
    for key, value in records[0].items():
        values = [r[key] for r in records]
        if key == "steps_taken":
            continue
        if key in ("peak_mem_bytes", "extra_mem_bytes"):
            out[key] = max(values)
        elif key == "state_mismatches":
            out[key] = sum(values)
        elif key == "restart_error":
            out[key] = next((v for v in values if v), None)
        elif key == "move_phases":
            out[key] = {name: statistics.median(v[name] for v in values) for name in value}
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and None not in values:
            out[key] = statistics.median(values)
    for key in SPREAD:
        values = [r[key] for r in records]
        known = None not in values
        out[f"{key}_min"], out[f"{key}_max"] = (min(values), max(values)) if known else (None, None)
        if not known:
            out[key] = None
    return out


def _transition(trainer: Trainer, after: Layout, tokens, root: Path, opts: SwitchBenchOptions) -> dict:
    """Steps 1 to 6 of the module's docstring for one transition; the record (complete on rank 0)."""
    before, rank, device = trainer.cfg.layout, trainer.rank, trainer.par.device
    link = link_rate(opts.p2p_bytes, opts.p2p_reps, device, opts.timeout_s)
    rate = link.bytes_per_s
    partial, save_s = _timed(lambda: checkpoint.write(trainer, str(root / "ckpt")), device)
    path, seal_s = _timed(lambda: checkpoint.publish(trainer, partial), device)
    restart, restart_error = None, None
    if opts.restart:
        _return_free_memory()
        if rank == 0:
            try:
                restart = restart_job(trainer.cfg.with_layout(after), path, trainer.progress.step,
                                   dist.get_world_size(), 0.9 * opts.timeout_s, root)
            except RestartFailed as err:  # a finding about the baseline: reported, not fatal
                print(f"shardshift: {before} -> {after}: {err}", file=sys.stderr, flush=True)
                restart_error = err.reason
        dist.barrier()  # the other ranks wait here, idle, while the fresh job runs

    build_s, load_s, ranks, loaded = _dcp_reference(trainer, after, path, tokens)
    if rank == 0:
        shutil.rmtree(path)
    steps_taken = trainer.progress.step
    prepared = trainer.prepare_switch(after, opts.budget)  # as the run loop does, a step ahead
    model = {"predicted_seconds": None}
    if opts.predict:  # the copy rates sample the state the switch will copy
        state = [local(t).detach() for t in trainer.state.tensors().values()]
        model = _predicted(prepared.schedule, state, link.typical_bytes_per_s, opts, device)
        del state
    dist.barrier()
    report = trainer.switch(prepared)
    switch_s = _max_over_ranks(report.seconds, device)
    assert trainer.par.ranks == ranks, (trainer.par.ranks, ranks)
    mismatches = torch.tensor([_mismatches(_digests(trainer), loaded)], device=device)
    dist.all_reduce(mismatches)
    result, step_s = _timed(trainer.train_step, device)
    record = {
        "from": str(before),
        "to": str(after),
        "placed": report.new,  # the new layout and the rank order the switch chose
        "steps_taken": steps_taken,  # optimizer steps before the switch
        "switch_seconds": switch_s,
        "move_seconds": report.move_seconds,
        "move_phases": report.move_phases,  # where the rounds spent it, each phase's slowest rank
        "move_cpu_seconds": report.move_cpu_seconds,  # processor time of every rank while moving, summed
        "move_page_faults": report.move_page_faults,  # pages of fresh memory every rank touched while moving, summed
        # of which what moving `bytes_moved` through the links costs, at the link measurement's cost per byte
        "transfer_cpu_seconds": report.bytes_moved * link.cpu_seconds_per_byte,
        "prepare_seconds": report.prepare_seconds,
        "dcp_seconds": save_s + load_s,
        "dcp_save_seconds": save_s,
        "seal_seconds": seal_s,  # the manifest's CRC-32s and the rename (`checkpoint.publish`): not DCP's
        "dcp_load_seconds": load_s,
        "dcp_build_seconds": build_s,
        "restart_seconds": None if restart is None else save_s + restart.seconds,
        "restart_step_seconds": None if restart is None else restart.step_seconds,
        "restart_job_seconds": None if restart is None else restart.job_seconds,
        "restart_error": restart_error,  # why the fresh job failed (rank 0), or None
        "limit_seconds": report.max_bytes_received / rate,
        **model,  # predicted_seconds, and with --predict what the model was given
        "link_bytes_per_s": rate,
        "link_cpu_seconds_per_byte": link.cpu_seconds_per_byte,
        "bytes_moved": report.bytes_moved,
        "bytes_kept": report.bytes_kept,
        "bytes_handed_over": report.bytes_handed_over,
        "bytes_lower_bound": report.bytes_lower_bound,
        "bytes_total": report.bytes_total,
        "max_bytes_received": report.max_bytes_received,
        "rounds": report.rounds,
        "budget": report.budget,
        "peak_mem_bytes": report.peak_mem_bytes,
        "extra_mem_bytes": report.extra_mem_bytes,
        "state_mismatches": int(mismatches),
        "step_after_seconds": step_s,
        "loss_after": result.loss,
    }
    for key, (a, b) in RATIOS.items():
        record[key] = _ratio(record[a], record[b])
    return record


def _return_free_memory() -> None:
    """Collect garbage and ask glibc, where it is the allocator, to give free heap pages back."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def _dcp_reference(trainer: Trainer, after: Layout, path: Path, tokens):
    """Build a trainer under `after`, placed as the switch will place it; DCP-load `path` into it.

    Returns the build's and the load's seconds, the rank order and the loaded state's digests; the
    trainer itself is dropped.
    """
    device = trainer.par.device
    cfg = trainer.cfg.with_layout(after)
    ranks = plan_transition(state_space(cfg.model, cfg.param_dtype), trainer.assignment, after).new.ranks

    def build():  # `Trainer` seeds the global generator; the load restores the checkpoint's
        return Trainer(cfg, trainer.rank, device.type, tokens=tokens, ranks=ranks)

    built, build_s = _timed(build, device)
    _, load_s = _timed(functools.partial(checkpoint.load, built, path), device)
    loaded = _digests(built)
    del built
    gc.collect()  # its state goes before the switch builds the same layout's
    return build_s, load_s, ranks, loaded


# ---- the report ---------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _geomean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(value: float | None) -> str:
    return "-" if value is None else f"±{100 * value:.0f}%"


def _size(nbytes: float) -> str:
    return format_size(nbytes, digits=2).replace(" ", "").removesuffix("iB")


def spread(record: dict, keys=("dcp_over_switch", "restart_over_switch", "switch_over_limit")) -> float | None:
    """How far the repeats of a transition strayed from their median, the most over the ratios
    `keys`: max |min ÷ median - 1|, |max ÷ median - 1| (0.2: within ±20%)."""
    out = [abs(record[f"{key}_{end}"] / record[key] - 1) for key in keys if record.get(key) for end in ("min", "max")]
    return max(out) if out else None


def report(opts: SwitchBenchOptions, records: list[dict], device_type: str) -> dict:
    """Print the summarised records (`summarise`) with their geometric means: one JSON object, or
    the table. Returns that object (what ``--json`` prints)."""
    cfg = opts.cfg
    means = {key: _geomean([r[key] for r in records]) for key in RATIOS}
    for r in records:
        r["spread"] = spread(r)
    result = {
        "model": cfg.model.name, "params": cfg.model.num_params(), "nproc": opts.nproc,
        "device": device_type, "cores": _cores(), "dtype": cfg.dtype, "global_batch": cfg.global_batch, "repeats": opts.repeat,
        "budget": records[0]["budget"], "transitions": records, "geomean": means,
    }  # fmt: skip
    if opts.json:
        print(json.dumps(result))
        return result
    print(f"model {cfg.model.name} ({cfg.model.num_params():,} parameters, {cfg.dtype}), {opts.nproc} "
          f"{device_type} ranks, budget {_size(records[0]['budget'])} per round; seconds, slowest rank; "
          f"medians of {opts.repeat} repeats ('spread': the farthest a repeat's ratio strayed from the median)")
    head = (f"{'transition':<28}{'switch':>8}{'dcp':>8}{'restart':>9}{'limit':>8} |{'dcp/sw':>8}"
            f"{'rst/sw':>8}{'sw/lim':>8}{'spread':>8} |{'moved':>9}{'of all':>9}{'peak':>9}{'extra':>9}{'link/s':>9}"
            f"{'bad':>4}")
    print(head)
    print("-" * len(head))
    for r in records:
        restart = "failed" if r.get("restart_error") else _fmt(r["restart_seconds"], ".2f")
        print(f"{r['from'] + ' -> ' + r['to']:<28}{r['switch_seconds']:>8.2f}{r['dcp_seconds']:>8.2f}"
              f"{restart:>9}{r['limit_seconds']:>8.2f} |"
              f"{_fmt(r['dcp_over_switch'], '.2f'):>8}{_fmt(r['restart_over_switch'], '.2f'):>8}"
              f"{_fmt(r['switch_over_limit'], '.2f'):>8}{_spread(r['spread']):>8} |{_size(r['bytes_moved']):>9}"
              f"{_size(r['bytes_total']):>9}{_size(r['peak_mem_bytes']):>9}{_size(r['extra_mem_bytes']):>9}"
              f"{_size(r['link_bytes_per_s']):>9}{r['state_mismatches']:>4}")
    print("-" * len(head))
    print(f"{'geometric mean':<61}|{_fmt(means['dcp_over_switch'], '.2f'):>8}"
          f"{_fmt(means['restart_over_switch'], '.2f'):>8}{_fmt(means['switch_over_limit'], '.2f'):>8}{'':>8} |")
    print(f"sealing the saves into checkpoints (manifest CRC-32s, rename; not in 'dcp'): "
          f"{sum(r['seal_seconds'] for r in records):.2f} s in all")
    print(f"processor time while moving, all ranks' processes (transport threads included) on {result['cores']} cores:")
    for r in records:
        busy = _ratio(r["move_cpu_seconds"], r["move_seconds"])
        print(f"  {r['from'] + ' -> ' + r['to']:<26} {r['move_cpu_seconds']:.2f} core-s in {r['move_seconds']:.2f} s "
              f"({_fmt(busy, '.1f')} cores busy); the links' cost of the bytes moved: {r['transfer_cpu_seconds']:.2f} "
              f"core-s ({1e9 * r['link_cpu_seconds_per_byte']:.2f} per GB); "
              f"{int(r['move_page_faults'])} pages first touched")
    if opts.predict:
        print("predicted on an alpha-beta model of this machine "
              "(link rate, per-message cost, copy rates, per-piece cost):")
        for r in records:
            print(f"  {r['from'] + ' -> ' + r['to']:<26} predicted {r['predicted_seconds']:.3f} s; moving took "
                  f"{r['move_seconds']:.3f} s (x{r['predicted_over_move']:.2f}), the switch {r['switch_seconds']:.3f} s "
                  f"(x{r['predicted_over_switch']:.2f}); copies at {r['model_copy_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"{r['model_strided_copy_bytes_per_s'] / 1e9:.1f} strided, "
                  f"{1e6 * r['model_piece_seconds']:.1f} us a piece, {1e6 * r['model_message_cpu_seconds']:.1f} "
                  f"core-us a message end")
        within = sum(1 for r in records if 0.7 <= r["predicted_over_move"] <= 1.3)
        print(f"  within 30% of the moving: {within} of {len(records)}; geometric mean x{means['predicted_over_move']:.2f} "
              f"of the moving, x{means['predicted_over_switch']:.2f} of the switch")
    for r in records:
        if r.get("restart_error"):
            print(f"restart failed for {r['from']} -> {r['to']}: {r['restart_error']}")
    return result
