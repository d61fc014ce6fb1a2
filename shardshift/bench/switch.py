"""`shardshift bench switch`: a layout switch measured four ways side by side in one run, one
transition at a time: the online switch, DCP save + load, a restart from DCP, and the links' limit.

    shardshift bench switch --nproc 4 --suite                  # the default chain, model base
    shardshift bench switch --nproc 4 --model tiny --from dp=4 --to fsdp=2,tp=2
    shardshift bench switch --nproc 2 --model test --suite 'dp=2;fsdp=2;pp=2' --json

One trainer walks a chain of layouts L0 → L1 → … on the bench's processes, after one step under L0
(so AdamW state exists). For each transition A → B, at a step boundary, in this order:

1. **Link rate** (``link_bytes_per_s``, `calibration.link_rate`): every ordered pair of ranks
   exchanges `p2p_bytes` at once, as a switch round does; the best of `p2p_reps` timed runs.
2. **DCP save** (``dcp_save_seconds``): `checkpoint.write` of the trainer under A (``dcp.save``),
   barrier to barrier; `checkpoint.publish` then seals it (``seal_seconds``, not counted).
3. **Restart** (``restart_seconds``; skipped with `restart=False`): rank 0 starts a fresh
   ``shardshift train --layout B --resume DIR`` job (`bench.restart`) while the other ranks wait,
   idle, in a barrier. ``restart_seconds`` is the save plus the time until the job's rank 0 starts
   its first step (that step: ``restart_step_seconds``; the job's whole life:
   ``restart_job_seconds``). A job that fails is reported (``restart_error``) and the bench goes on.
4. **DCP load** (``dcp_load_seconds``): a fresh trainer under B, placed as the switch will place it
   (its build: ``dcp_build_seconds``, not counted), filled by `checkpoint.load`. Its tensors'
   digests are kept, and the trainer and the checkpoint dropped.
5. **Online switch** (``switch_seconds``): `Trainer.prepare_switch` first (``prepare_seconds``, not
   counted: training prepares a switch ahead while it trains), then `Trainer.switch`: the slowest
   rank's `SwitchReport.seconds`, until the trainer is ready for its next step. The switched state
   must equal the DCP-loaded one bit for bit (``state_mismatches``: 0 is the only correct value).
6. One training step on the switched trainer (``step_after_seconds``, ``loss_after``).

``dcp_seconds`` is save + load. ``limit_seconds`` is `SwitchReport.max_bytes_received` ÷ the link
rate: no switch finishes before its busiest receiver has taken its bytes in at the rate the links
give when every pair is busy (local copies are not in it). ``floor_seconds`` adds the copies the
executor must make (``copy_floor_seconds``: the slowest rank's `SwitchProgram.copied_bytes`, local
copies of pieces not handed over and staged messages, at the contiguous rate it copies its own
state, `calibration.copy_rates`); ``switch_over_floor`` is what remains. ``time_split`` divides the
switch: ``plan`` (preparing, not counted), ``open``, ``pack``, ``wire`` (posting the sends, waiting
for the receives and the sends), ``copy``, ``unpack``, ``close`` (each phase the slowest rank's), and
``rebuild`` (the switch less the moving). ``pieces_per_rank``, ``host_calls_per_rank`` and
``host_calls_before_per_rank`` are the busiest rank's from the schedule
(`reshard.execute.calls_per_rank`: coalesced, and copying piece by piece). Every time is the slowest rank's.
``move_seconds`` is the part of the switch that runs its schedule; ``move_cpu_seconds`` the
processor time of every rank's process meanwhile, summed, and ``transfer_cpu_seconds`` what the
bytes moved cost at the link measurement's processor time per byte; ``move_page_faults`` the pages
of fresh memory the ranks touched while moving.

**Repeats.** Each transition is measured `repeat` times, switching back to A (unmeasured) between
them. Its record (`summarise`) holds the median of every figure, with ``*_min`` and ``*_max``
beside the times, the link rate and the ratios (`SPREAD`); the most peak and extra memory of any
repeat; the sum of the mismatches. ``spread`` is the farthest any of dcp/sw, rst/sw and sw/lim
strayed from its median.

**Memory.** Before a restart every rank hands its allocator's free memory back to the system
(glibc's ``malloc_trim``): the fresh job's processes run beside the bench's own. Nothing is handed
back before a switch, as a running job does not do it either.

**Prediction** (``predict``): before each switch the machine is measured (`bench.calibration`) and
the switch's own schedule timed on the α–β model of it (`simulate.cluster`; on a CPU host with
glibc, with the kernel's work on pages, `simulate.host_memory`). ``predicted_seconds`` stands beside
``move_seconds`` (``predicted_over_move``) and ``switch_seconds`` (``predicted_over_switch``: the
rest is building the new layout's optimizer and wrappers, which the model leaves out). The record
keeps what the model was given (``model_*``) and the bytes it booked on fresh pages and handed
back to the kernel (``predicted_fresh_bytes``, ``predicted_unmapped_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from shardshift.bench.calibration import Calibration, LinkRate, link_rate, max_over_ranks, measure_machine, usable_cores
from shardshift.bench.restart import Restart, RestartFailed, restart_job
from shardshift.console import say
from shardshift.data.corpus import open_corpus
from shardshift.launch import STORE_ENV
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.plots.canvas import check_drawable
from shardshift.reshard.plan import plan_transition
from shardshift.runtime import run_in_group
from shardshift.simulate.host_memory import PageWork
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.memory import return_free_memory
from shardshift.train.state import local
from shardshift.train.switch import SwitchReport
from shardshift.train.trainer import Trainer
from shardshift.units import format_size

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


@dataclasses.dataclass(frozen=True)
class PredictedSwitch:
    """A switch's schedule timed on the model of this machine (``--predict``), and what it was given."""

    seconds: float
    machine: Calibration
    pages: PageWork | None  # the kernel's work on pages, where it is modelled (`Calibration.work_on_pages`)

    def as_dict(self) -> dict:
        """``predicted_seconds`` and the ``model_*`` figures, in the order ``--json`` prints them."""
        m, known = self.machine, self.pages is not None
        return {"predicted_seconds": self.seconds, "model_link_bytes_per_s": m.link_bytes_per_s,
                "model_message_seconds": m.message_seconds, "model_message_cpu_seconds": m.message_cpu_seconds,
                "model_pair_bytes_per_s": m.pair_bytes_per_s, "model_copy_bytes_per_s": m.copy_bytes_per_s,
                "model_strided_copy_bytes_per_s": m.strided_copy_bytes_per_s, "model_piece_seconds": m.piece_seconds,
                "model_fresh_page_bytes_per_s": m.pages.fresh_page_bandwidth if known else None,
                "model_free_bytes_per_s": m.pages.free_bandwidth if known else None,
                "model_heap_free_bytes": list(m.memory.free_bytes) if known else None,
                "model_mapped_share": list(m.memory.mapped_share) if known else None,
                "predicted_fresh_bytes": self.pages.fresh_bytes if known else None,
                "predicted_unmapped_bytes": self.pages.unmapped_bytes if known else None}


@dataclasses.dataclass(frozen=True)
class HostWork:
    """What the executor does per rank in a switch, from its schedule (`reshard.execute.calls_per_rank`:
    the most of any rank), and the least time its copies take."""

    pieces: int  # segment ends one rank handles
    host_calls: int  # calls that do work: copies, staging allocations, posts and waits, hand-overs
    host_calls_before: int  # the same, copying piece by piece
    copy_floor_seconds: float  # the slowest rank's bytes it must copy at its measured contiguous copy rate


def _host_figures(host: HostWork | None, report: SwitchReport, limit: float) -> dict:
    """The ``time_split``, ``floor_seconds`` and host figures of a record (None where not measured)."""
    phases = report.move_phases
    split = {"plan": report.prepare_seconds, "open": phases.get("open", 0.0), "pack": phases.get("pack", 0.0),
             "wire": sum(phases.get(name, 0.0) for name in ("send", "receive", "wait")),
             "copy": phases.get("copy", 0.0), "unpack": phases.get("unpack", 0.0), "close": phases.get("close", 0.0),
             "rebuild": report.seconds - report.move_seconds}
    known = host is not None
    return {"time_split": split, "floor_seconds": limit + host.copy_floor_seconds if known else None,
            "copy_floor_seconds": host.copy_floor_seconds if known else None,
            "pieces_per_rank": host.pieces if known else None, "host_calls_per_rank": host.host_calls if known else None,
            "host_calls_before_per_rank": host.host_calls_before if known else None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchRun:
    """One measurement of a transition: steps 1 to 6 of the module docstring (complete on rank 0)."""

    before: Layout
    after: Layout
    steps_taken: int  # optimizer steps before the switch
    link: LinkRate  # step 1
    dcp_save_seconds: float
    seal_seconds: float  # the manifest's CRC-32s and the rename (`checkpoint.publish`): not DCP's
    restart: Restart | None  # None: not measured, or failed
    restart_error: str | None  # why the fresh job failed (rank 0), or None
    dcp_build_seconds: float
    dcp_load_seconds: float
    switch: SwitchReport  # the switch's byte and memory figures are the worst rank's
    switch_seconds: float  # the slowest rank's `SwitchReport.seconds`
    predicted: PredictedSwitch | None  # with ``predict``
    state_mismatches: int  # tensors that differ from the DCP-loaded ones, over all ranks
    step_after_seconds: float
    loss_after: float
    host: HostWork | None = None  # the executor's work per rank and the copies' floor

    def as_dict(self) -> dict:
        """The record ``--json`` prints for one repeat (before `summarise`), its ratios (`RATIOS`) last."""
        report, save, restart = self.switch, self.dcp_save_seconds, self.restart
        record = {
            "from": str(self.before), "to": str(self.after),
            "placed": report.new,  # the new layout and the rank order the switch chose
            "steps_taken": self.steps_taken,
            "switch_seconds": self.switch_seconds, "move_seconds": report.move_seconds,
            "move_phases": report.move_phases,  # where the rounds spent it, each phase's slowest rank
            "move_cpu_seconds": report.move_cpu_seconds, "move_page_faults": report.move_page_faults,
            "transfer_cpu_seconds": report.bytes_moved * self.link.cpu_seconds_per_byte,
            "prepare_seconds": report.prepare_seconds,
            "dcp_seconds": save + self.dcp_load_seconds, "dcp_save_seconds": save, "seal_seconds": self.seal_seconds,
            "dcp_load_seconds": self.dcp_load_seconds, "dcp_build_seconds": self.dcp_build_seconds,
            "restart_seconds": None if restart is None else save + restart.seconds,
            "restart_step_seconds": None if restart is None else restart.step_seconds,
            "restart_job_seconds": None if restart is None else restart.job_seconds,
            "restart_error": self.restart_error,
            "limit_seconds": report.max_bytes_received / self.link.bytes_per_s,
            **(self.predicted.as_dict() if self.predicted is not None else {"predicted_seconds": None}),
            "link_bytes_per_s": self.link.bytes_per_s, "link_cpu_seconds_per_byte": self.link.cpu_seconds_per_byte,
            "bytes_moved": report.bytes_moved, "bytes_kept": report.bytes_kept,
            "bytes_handed_over": report.bytes_handed_over, "bytes_lower_bound": report.bytes_lower_bound,
            "bytes_total": report.bytes_total, "max_bytes_received": report.max_bytes_received,
            "rounds": report.rounds, "budget": report.budget,
            "peak_mem_bytes": report.peak_mem_bytes, "extra_mem_bytes": report.extra_mem_bytes,
            "state_mismatches": self.state_mismatches, "step_after_seconds": self.step_after_seconds,
            "loss_after": self.loss_after,
            **_host_figures(self.host, report, report.max_bytes_received / self.link.bytes_per_s),
        }
        for key, (a, b) in RATIOS.items():
            record[key] = _ratio(record[a], record[b])
        return record


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchBenchResult:
    """What ``--json`` prints: the run's setting, one record per transition (`summarise`) and the
    geometric mean of each ratio over the transitions."""

    model: str
    params: int
    nproc: int
    device: str  # "cpu" or "cuda"
    cores: int  # the processors the ranks share (`calibration.usable_cores`)
    dtype: str
    global_batch: int
    repeats: int
    budget: int  # bytes per switch round
    transitions: tuple[dict, ...]
    geomean: dict[str, float | None]  # by ratio (`RATIOS`); None where no transition has it

    def as_dict(self) -> dict:
        out = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**out, "transitions": list(self.transitions)}


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
    """Walk the chain; one record per transition (`summarise`), complete on rank 0."""
    cfg, chain = opts.cfg, opts.chain
    corpus = open_corpus(cfg.data)
    trainer = Trainer(cfg, rank, device_type, corpus=corpus, timeout_s=opts.timeout_s)
    trainer.train_step()  # AdamW state exists from here on
    root = [tempfile.mkdtemp(prefix="shardshift-bench-switch-", dir=_scratch_parent()) if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    root = Path(root[0])
    try:
        return [_repeated(trainer, after, corpus, root, opts) for after in chain[1:]]
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _repeated(trainer: Trainer, after: Layout, corpus, root: Path, opts: SwitchBenchOptions) -> dict:
    """`opts.repeat` measurements of the switch from the trainer's layout to `after` (switching back
    between them, unmeasured), summarised in one record (`summarise`)."""
    before = trainer.cfg.layout
    runs = []
    for repeat in range(opts.repeat):
        if repeat:
            trainer.switch(trainer.prepare_switch(before, opts.budget))
        runs.append(_transition(trainer, after, corpus, root, opts))
    return summarise([run.as_dict() for run in runs])


def _transition(trainer: Trainer, after: Layout, corpus, root: Path, opts: SwitchBenchOptions) -> SwitchRun:
    """Steps 1 to 6 of the module's docstring for one transition."""
    before, rank, device = trainer.cfg.layout, trainer.rank, trainer.par.device
    link = link_rate(opts.p2p_bytes, opts.p2p_reps, device, opts.timeout_s)
    partial, save_s = _timed(lambda: checkpoint.write(trainer, str(root / "ckpt")), device)
    path, seal_s = _timed(lambda: checkpoint.publish(trainer, partial), device)
    restart, restart_error = None, None
    if opts.restart:
        return_free_memory()
        if rank == 0:
            try:
                restart = restart_job(trainer.cfg.with_layout(after), path, trainer.progress.step,
                                      dist.get_world_size(), 0.9 * opts.timeout_s, root)
            except RestartFailed as err:  # a finding about the baseline: reported, not fatal
                print(f"shardshift: {before} -> {after}: {err}", file=sys.stderr, flush=True)
                restart_error = err.reason
        dist.barrier()  # the other ranks wait here, idle, while the fresh job runs

    build_s, load_s, ranks, loaded = _dcp_reference(trainer, after, path, corpus)
    if rank == 0:
        shutil.rmtree(path)
    steps_taken = trainer.progress.step
    prepared = trainer.prepare_switch(after, opts.budget)  # as the run loop does, a step ahead
    predicted = None
    state = [local(t).detach() for t in trainer.state.tensors().values()]
    if opts.predict:  # the copy rates sample the state the switch will copy
        predicted = _predicted(prepared.schedule, state, link.typical_bytes_per_s, opts, device)
    host = _host_work(prepared, state, opts, device)
    del state
    dist.barrier()
    switch = trainer.switch(prepared)
    switch_s = max_over_ranks(switch.seconds, device)
    assert trainer.par.ranks == ranks, (trainer.par.ranks, ranks)
    mismatches = torch.tensor([_mismatches(_digests(trainer), loaded)], device=device)
    dist.all_reduce(mismatches)
    result, step_s = _timed(trainer.train_step, device)
    return SwitchRun(before=before, after=after, steps_taken=steps_taken, link=link, dcp_save_seconds=save_s,
                     seal_seconds=seal_s, restart=restart, restart_error=restart_error, dcp_build_seconds=build_s,
                     dcp_load_seconds=load_s, switch=switch, switch_seconds=switch_s, predicted=predicted,
                     state_mismatches=int(mismatches), step_after_seconds=step_s, loss_after=result.loss,
                     host=host)


def _host_work(prepared, state: Sequence[torch.Tensor], opts: SwitchBenchOptions, device: torch.device) -> HostWork:
    """The executor's work per rank for `prepared` (`HostWork`); the copy floor at the rate this
    rank copies its own state (`calibration.copy_rates`, contiguous)."""
    from shardshift.bench.calibration import copy_rates
    from shardshift.reshard.execute import calls_per_rank

    counts = calls_per_rank(prepared.schedule)
    rate, _ = copy_rates(state, opts.p2p_bytes, device)
    floor = max_over_ranks(prepared.program.copied_bytes / rate, device)
    return HostWork(int(counts.pieces.max(initial=0)), int(counts.after.max(initial=0)),
                    int(counts.before.max(initial=0)), floor)


def _predicted(schedule, state: Sequence[torch.Tensor], rate: float, opts: SwitchBenchOptions,
               device: torch.device) -> PredictedSwitch:
    """The switch's schedule timed on an α–β model of this machine measured now (`measure_machine`,
    its link rate `rate` measured before)."""
    from shardshift.simulate.cluster import predict

    machine = measure_machine(state, rate, opts.p2p_bytes, opts.p2p_reps, opts.timeout_s, device)
    pages = machine.work_on_pages(schedule)
    prediction = predict(schedule, machine.cluster(), None if pages is None else pages.seconds)
    return PredictedSwitch(prediction.seconds, machine, pages)


def _timed(fn, device: torch.device):
    """(fn(), the slowest rank's seconds), all ranks starting together."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return result, max_over_ranks(time.perf_counter() - start, device)


def _dcp_reference(trainer: Trainer, after: Layout, path: Path, corpus):
    """Build a trainer under `after`, placed as the switch will place it; DCP-load `path` into it.

    Returns the build's and the load's seconds, the rank order and the loaded state's digests; the
    trainer itself is dropped.
    """
    device = trainer.par.device
    cfg = trainer.cfg.with_layout(after)
    ranks = plan_transition(state_space(cfg.model, cfg.param_dtype), trainer.assignment, after).new.ranks

    def build():  # `Trainer` seeds the global generator; the load restores the checkpoint's
        return Trainer(cfg, trainer.rank, device.type, corpus=corpus, ranks=ranks)

    built, build_s = _timed(build, device)
    _, load_s = _timed(functools.partial(checkpoint.load, built, path), device)
    loaded = _digests(built)
    del built
    gc.collect()  # its state goes before the switch builds the same layout's
    return build_s, load_s, ranks, loaded


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


# Per repeat, then summarised by their median, with the least and the most beside it (``*_min``,
# ``*_max``): the times, the link rate and the ratios of each repeat.
SPREAD = ("switch_seconds", "move_seconds", "dcp_seconds", "dcp_save_seconds", "dcp_load_seconds", "restart_seconds",
          "limit_seconds", "predicted_seconds", "link_bytes_per_s", "dcp_over_switch", "restart_over_switch",
          "switch_over_limit", "predicted_over_switch", "predicted_over_move", "floor_seconds", "switch_over_floor")
RATIOS = {"dcp_over_switch": ("dcp_seconds", "switch_seconds"),
          "restart_over_switch": ("restart_seconds", "switch_seconds"),
          "switch_over_limit": ("switch_seconds", "limit_seconds"),
          "switch_over_floor": ("switch_seconds", "floor_seconds"),
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
        elif key in ("move_phases", "time_split"):
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
    result = SwitchBenchResult(
        model=cfg.model.name, params=cfg.model.num_params(), nproc=opts.nproc, device=device_type,
        cores=usable_cores(), dtype=cfg.dtype, global_batch=cfg.global_batch, repeats=opts.repeat,
        budget=records[0]["budget"], transitions=tuple(records), geomean=means,
    ).as_dict()
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
    print("the floor (limit + the copies a rank must make, at its copy rate), where the time went (slowest rank "
          "per phase) and the executor's work on the busiest rank:")
    for r in records:
        split = ", ".join(f"{name} {seconds:.3f}" for name, seconds in r["time_split"].items())
        print(f"  {r['from'] + ' -> ' + r['to']:<26} floor {_fmt(r['floor_seconds'], '.3f')} s "
              f"(copies {_fmt(r['copy_floor_seconds'], '.3f')}), sw/floor {_fmt(r['switch_over_floor'], '.2f')}; "
              f"{split}; {_fmt(r['pieces_per_rank'], '.0f')} pieces, {_fmt(r['host_calls_per_rank'], '.0f')} host calls "
              f"({_fmt(r['host_calls_before_per_rank'], '.0f')} piece by piece)")
    if opts.predict:
        print("predicted on an alpha-beta model of this machine "
              "(link rate, per-message cost, copy rates, per-piece cost):")
        for r in records:
            print(f"  {r['from'] + ' -> ' + r['to']:<26} predicted {r['predicted_seconds']:.3f} s; moving took "
                  f"{r['move_seconds']:.3f} s (x{r['predicted_over_move']:.2f}), "
                  f"the switch {r['switch_seconds']:.3f} s "
                  f"(x{r['predicted_over_switch']:.2f}); copies at {r['model_copy_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"{r['model_strided_copy_bytes_per_s'] / 1e9:.1f} strided, "
                  f"{1e6 * r['model_piece_seconds']:.1f} us a piece, {1e6 * r['model_message_cpu_seconds']:.1f} "
                  f"core-us a message end")
        within = sum(1 for r in records if 0.7 <= r["predicted_over_move"] <= 1.3)
        print(f"  within 30% of the moving: {within} of {len(records)}; "
              f"geometric mean x{means['predicted_over_move']:.2f} of the moving, "
              f"x{means['predicted_over_switch']:.2f} of the switch")
    for r in records:
        if r.get("restart_error"):
            print(f"restart failed for {r['from']} -> {r['to']}: {r['restart_error']}")
    return result
