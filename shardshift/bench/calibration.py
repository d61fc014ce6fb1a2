"""What `bench switch --predict` measures of the machine, before each switch and on the bench's
own processes, to time the switch's schedule on an α–β model of it (`simulate.cluster`: one host
of the job's ranks) and, on a CPU host with glibc, on a model of its memory
(`simulate.host_memory`).

- the link rate (`link_rate`): every ordered pair of ranks exchanges at once, as a switch round
  does; its median run is the model's host bandwidth (its best run is the bench's limit);
- a rank's port (`pair_rate`): the rate of one pair exchanging alone (ranks 0 and 1, both ways).
  On CPU a rank's process handles both ends of its transfers, so the model's port passes bytes in
  and out together at twice that rate;
- the cost of a message end (`message_cost`): a round of tiny messages to and from every peer,
  over the message ends, in time and in processor time (the transport's threads included), which
  a CPU host's model books on its cores beside the copies;
- the copy rates (`copy_rates`): local copies out of the rank's own state (disjoint samples of it,
  each copied once, as the switch copies it) into memory written before, from whole tensors and
  from the first half of every row of its matrices (a strided slice);
- the cost of a piece end beside its bytes (`piece_cost`): the executor itself (`run_program`)
  making many local copies of a small slice, as it does for each part it packs, unpacks or copies;
- on CPU, the kernel's work on pages (`page_rates`): mapping and zeroing fresh pages as a copy
  first writes them, beyond the copy, and taking written pages back when a mapping is released;
  where glibc is the allocator, what each rank's allocator holds as the switch starts
  (`heap_state`: its free heap bytes, and the share of its live bytes it mapped apart).

The copies, the piece cost and the page rates are measured by every rank at once, as a switch's
ranks copy at once, sharing the memory and its caches; the model takes the mean over the ranks.
On CPU they are measured in the processor time of the measuring process, so that ranks sharing
fewer cores than ranks are not charged for waiting for one: the model gives every rank's copies to
the host's cores (`Cluster.host_cores`), where they take turns with the transport.

Every figure is the median of its timed runs, except the page rates (each a difference of two
copies, which single noisy pairs can make 0: the fastest of each). The model predicts a typical
switch, and is compared with the median of the bench's repeats; inputs at their best would make
every term optimistic at once.

`measure_machine` takes them all (a `Calibration`), which gives the α–β model of the machine
(`Calibration.cluster`) and the kernel's work on pages over a schedule (`Calibration.work_on_pages`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
import os
import statistics
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist

from shardshift.comm.p2p import Deadline, PeerOp, Transport
from shardshift.reshard.execute import Copy, RoundWork, SwitchProgram, run_program
from shardshift.simulate.cluster import Cluster
from shardshift.simulate.host_memory import HostMemory, PageRates, PageWork, page_work

_P2P_TAG = 1 << 20  # above any switch round's tag


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """The machine as `measure_machine` measured it: the inputs of its α–β model (module docstring)."""

    ranks: int
    cores: int  # the processors the ranks share, where they copy and move the bytes too (a CPU host); 0: GPUs
    link_bytes_per_s: float  # what one rank receives when every pair exchanges at once (the link rate's median run)
    message_seconds: float  # one message end, many in flight
    message_cpu_seconds: float  # the processor time of one, every rank's process (booked on a CPU host's cores)
    pair_bytes_per_s: float  # one pair exchanging alone, each way
    copy_bytes_per_s: float  # a local copy out of the state, contiguous
    strided_copy_bytes_per_s: float  # the same out of half rows
    piece_seconds: float  # one piece end beside its bytes
    pages: PageRates | None  # the kernel's rates (CPU host), where the allocators' state is known
    memory: HostMemory | None  # every rank's allocator as the switch starts (glibc on a CPU host), else None

    def cluster(self) -> Cluster:
        """One host of `ranks` ranks at the measured rates."""
        cpu = self.cores > 0
        port = 2 * self.pair_bytes_per_s if cpu else self.pair_bytes_per_s  # a CPU rank passes in and out together
        return Cluster(hosts=1, gpus_per_host=self.ranks, intra_bandwidth=port,
                       host_bandwidth=self.ranks * self.link_bytes_per_s, intra_latency=self.message_seconds,
                       nics_per_host=1, nic_bandwidth=self.link_bytes_per_s, latency=self.message_seconds,
                       copy_bandwidth=self.copy_bytes_per_s, strided_copy_bandwidth=self.strided_copy_bytes_per_s,
                       host_cores=self.cores, piece_seconds=self.piece_seconds,
                       message_host_seconds=self.message_cpu_seconds if cpu else 0.0, name="this machine")

    def work_on_pages(self, schedule) -> PageWork | None:
        """The kernel's work on the ranks' pages over `schedule`, or None where it is not modelled
        (on GPUs, or where the allocators' state is not known)."""
        if self.pages is None or self.memory is None:
            return None
        return page_work(schedule, self.pages, self.memory)


def measure_machine(state: Sequence[torch.Tensor], link_bytes_per_s: float, nbytes: int, reps: int,
                    timeout_s: float, device: torch.device) -> Calibration:
    """Every figure of the module docstring but the link rate (measured before, given here), on
    every rank at once: messages and pairs of `nbytes` timed `reps` times each, copies sampled out
    of this rank's `state` (its local tensors). The same `Calibration` on every rank."""
    memory = _host_memory(device)  # before the measurements below allocate and free
    alpha, alpha_cpu = message_cost(reps, device, timeout_s)
    alone = pair_rate(nbytes, reps, device, timeout_s)
    copies, strided, piece, fresh, unmap = _local_rates(state, nbytes, device)
    cpu = device.type != "cuda"  # on CPU the ranks' copies and messages share the cores with the transport
    return Calibration(
        ranks=dist.get_world_size(), cores=usable_cores() if cpu else 0, link_bytes_per_s=link_bytes_per_s,
        message_seconds=alpha, message_cpu_seconds=alpha_cpu, pair_bytes_per_s=alone, copy_bytes_per_s=copies,
        strided_copy_bytes_per_s=strided, piece_seconds=piece, memory=memory,
        pages=None if memory is None else PageRates(fresh_page_bandwidth=fresh, free_bandwidth=unmap))


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's `value` (the slowest rank's time), on every rank."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


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
        seconds = max_over_ranks(mine, device)
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
        pairs = ((p, tag) for p in peers for tag in tags)
        transport.post_round([PeerOp(p, send, tag) for p in peers for tag in tags],
                             [PeerOp(p, buf, tag) for (p, tag), buf in zip(pairs, inbox)],
                             "measuring the per-message cost").wait(Deadline.after(timeout_s))
        seconds, cpu = max_over_ranks(time.perf_counter() - start, device), time.process_time() - start_cpu
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
        seconds = max_over_ranks(time.perf_counter() - start, device)
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

    Out of the state, each part once, because that is what a switch copies (a buffer made for the
    measurement and copied again and again would be copied out of the caches). Into memory written
    before: a tensor allocated for the measurement alone gets fresh pages on CPU, which the kernel
    faults in and zeroes during the copy (the model books fresh pages apart: `simulate.host_memory`)."""
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


def _local_rates(state: Sequence[torch.Tensor], nbytes: int, device: torch.device) -> tuple[float, ...]:
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


def _host_memory(device: torch.device) -> HostMemory | None:
    """Every rank's `heap_state`, or None where a rank's allocator is not glibc or the ranks copy
    on GPUs."""
    state = heap_state() if device.type == "cpu" else None
    figures = torch.tensor([*(state or (0.0, 0.0)), state is not None], dtype=torch.float64, device=device)
    every = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
    dist.all_gather(every, figures)
    if not all(bool(f[2]) for f in every):
        return None
    return HostMemory(tuple(float(f[0]) for f in every), tuple(float(f[1]) for f in every))


def usable_cores() -> int:
    """The processors this rank may run on (its affinity), which the machine's ranks share."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
