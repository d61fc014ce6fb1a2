"""`shardshift bench elastic`: membership changes in the running job against the checkpoint-and-restart
way, side by side in one run.

    shardshift bench elastic --nproc 4 --model base --suite --json

1. **The elastic job.** One `shardshift train --elastic` job runs the scripted events (the default
   suite, from 4 workers under HSDP, ``dp=2,fsdp=2``, so that every shard has a replica: a crash
   4 -> 3, a leave 3 -> 2, joins 2 -> 3 -> 4, a crash 4 -> 3, a join 3 -> 4; worlds of 3 and 2 run
   FSDP). Its metrics give each event's
   ``pause_seconds`` (from the decision at the step boundary until every worker of the new world
   is ready to step, the slowest worker's), ``detect_seconds``, ``bytes_moved`` and ``steps_lost``.
   It saves a checkpoint after every step (``--save-every 1``) for the baseline; the saves happen
   between steps and are not part of any pause.
2. **Restart** (``restart_seconds``): for each event, a fresh job of the new world's size and
   layout (`bench.restart.restart_job`: new processes, imports, process group, trainer) resumes
   from the checkpoint of the step the event followed, the baseline's best case: no steps lost,
   no time to notice the change, the save already done. ``restart_seconds`` is the time from
   spawning it until it starts its first step (that step itself: ``restart_step_seconds``).

3. **What redundancy costs** (``redundancy_overhead``): two fixed jobs of the first world's size
   under FSDP over all of it (no replicas: ``--redundancy 1`` keeps a copy of every piece), one
   with ``--redundancy 0`` and one with ``--redundancy 1``, `--overhead-steps` steps each. The
   overhead is ``1 - tokens/s with / tokens/s without``, from each job's median step after the
   first (the first step pays for start-up). The copies' first fill, when a world opens, is in
   every event's pause and not in this figure.

The ratios are ``restart_seconds / pause_seconds``, with their geometric means for joins and
leaves together and for crashes; the crashes' pauses are summed up as their median and maximum.

``--crashes N`` is a job of crashes alone: a 3-worker ring (``dp=3``; ``dp=2`` between a crash and
the join that follows it) loses a worker inside steps 2, 4, ... (a SIGKILL before its vote, each
time another rank) and gets one back after steps 3, 5, ...: N crash pauses, their median and
maximum, with the job's own ``--timeout`` (none of them may wait for it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from shardshift.bench.restart import Restart, RestartFailed, restart_job
from shardshift.elastic.config import ElasticConfig, Inject, check_every_world
from shardshift.launch import dies_with_this_process
from shardshift.layout import Layout
from shardshift.train.argv import train_argv
from shardshift.train.config import TrainConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticBenchOptions:
    """What `shardshift bench elastic` runs; validated when built (ValueError says what to change)."""

    cfg: TrainConfig  # the first world's run; its --steps is one past the last event
    nproc: int
    injects: tuple[Inject, ...]
    layouts: tuple[tuple[int, Layout], ...]  # --layout-for
    restart: bool = True
    overhead_steps: int = 4  # steps of each job that measures --redundancy 1 (0: not measured)
    timeout_s: float = 600.0
    json: bool = False

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise ValueError(f"--nproc {self.nproc}: give at least 2 workers")
        if not self.injects:
            raise ValueError("no events: give --suite, --crashes N or --inject STEP:EVENT")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s} must be > 0 seconds")
        if self.overhead_steps == 1 or self.overhead_steps < 0:
            raise ValueError(f"--overhead-steps {self.overhead_steps}: give 0 (skip) or at least 2 (the first "
                             "step is not counted)")
        if self.overhead_steps:
            self.cfg.with_layout(Layout(fsdp=self.nproc))  # the overhead jobs' layout
        low, high = self.worlds
        if low < 1:
            raise ValueError(f"the events leave {low} workers; the job needs at least one")
        check_every_world(self.elastic(low, high), self.cfg)

    def elastic(self, low: int, high: int) -> ElasticConfig:
        return ElasticConfig(min_nproc=low, max_nproc=high, layouts=self.layouts, injects=self.injects)

    @property
    def worlds(self) -> tuple[int, int]:
        """The smallest and largest world the script goes through."""
        world, low, high = self.nproc, self.nproc, self.nproc
        for inject in sorted(self.injects, key=lambda i: i.step):
            world += inject.count if inject.kind == "join" else -inject.count
            low, high = min(low, world), max(high, world)
        return low, high


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventRecord:
    """One change of world in the elastic job (its metrics' ``membership`` event), beside its restart.
    Figures the event does not have are None."""

    kind: str  # "join", "leave" or "crash"
    step: int  # the step the change followed
    from_world: int
    to_world: int
    before: str  # the old world's layout
    after: str  # the new world's layout
    pause_seconds: float  # the decision at the step boundary -> every worker of the new world ready to step
    detect_seconds: float
    steps_lost: int
    bytes_moved: int
    recovered_from: str | None  # where the state came from: "none", "replica", "redundancy", "checkpoint"
    planned_ahead: bool | None
    phases: dict[str, float] | None  # the move's phases, each its slowest worker's seconds
    restart: Restart | None = None  # the fresh job of the new world (`_restart`), when measured and it ran
    restart_error: str | None = None  # why that job failed

    @classmethod
    def from_metrics(cls, event: dict, restart: Restart | None = None, restart_error: str | None = None) -> EventRecord:
        return cls(kind=event.get("kind"), step=event.get("step"), from_world=event.get("from_world"),
                   to_world=event.get("to_world"), before=event.get("from"), after=event.get("to"),
                   pause_seconds=event.get("pause_seconds"), detect_seconds=event.get("detect_seconds"),
                   steps_lost=event.get("steps_lost"), bytes_moved=event.get("bytes_moved"),
                   recovered_from=event.get("recovered_from"), planned_ahead=event.get("planned_ahead"),
                   phases=event.get("phases"), restart=restart, restart_error=restart_error)

    @property
    def restart_seconds(self) -> float | None:
        return None if self.restart is None else self.restart.seconds

    @property
    def restart_over_pause(self) -> float | None:
        return (self.restart_seconds / self.pause_seconds
                if self.restart_seconds and self.pause_seconds > 0 else None)

    def as_dict(self) -> dict:
        """The event as ``--json`` prints it."""
        return {"kind": self.kind, "step": self.step, "from_world": self.from_world, "to_world": self.to_world,
                "from": self.before, "to": self.after, "pause_seconds": self.pause_seconds,
                "detect_seconds": self.detect_seconds, "restart_seconds": self.restart_seconds,
                "restart_step_seconds": None if self.restart is None else self.restart.step_seconds,
                "restart_over_pause": self.restart_over_pause, "steps_lost": self.steps_lost,
                "bytes_moved": self.bytes_moved, "recovered_from": self.recovered_from,
                "planned_ahead": self.planned_ahead, "restart_error": self.restart_error, "phases": self.phases}


@dataclasses.dataclass(frozen=True)
class RedundancyOverhead:
    """What ``--redundancy 1`` costs a fixed job (`_redundancy_overhead`)."""

    layout: str  # FSDP over the first world: no replica
    steps: int  # of each job
    step_seconds: float  # the median step after the first, ``--redundancy 0``
    step_seconds_redundancy_1: float  # the same with ``--redundancy 1``
    overhead: float  # 1 - tokens/s with / tokens/s without


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticBenchResult:
    """What ``--json`` prints."""

    model: str
    params: int
    dtype: str
    global_batch: int
    events: tuple[EventRecord, ...]
    geomean_restart_over_pause: dict[str, float | None]  # joins and leaves ("join_leave"), crashes (`summary`)
    crash_pauses: dict[str, float | int | None]  # the crashes' pauses: count, median, max (`crash_pauses`)
    median_step_seconds: float  # of the elastic job
    redundancy: RedundancyOverhead | None  # None: not measured

    def as_dict(self) -> dict:
        return {"model": self.model, "params": self.params, "dtype": self.dtype, "global_batch": self.global_batch,
                "events": [e.as_dict() for e in self.events],
                "geomean_restart_over_pause": self.geomean_restart_over_pause,
                "crash_pauses": self.crash_pauses, "median_step_seconds": self.median_step_seconds,
                "redundancy_overhead": None if self.redundancy is None else self.redundancy.overhead,
                "redundancy": None if self.redundancy is None else dataclasses.asdict(self.redundancy)}


def run_elastic_bench(opts: ElasticBenchOptions) -> int:
    """Run the elastic job, then the restarts; print the report. The exit status: 0, or 1 when the
    elastic job failed."""
    work = Path(tempfile.mkdtemp(prefix="shardshift-bench-elastic-"))
    try:
        metrics, ckpt = work / "run.jsonl", work / "ckpt"
        cfg = dataclasses.replace(opts.cfg, save=str(ckpt), save_every=1, metrics=str(metrics))
        low, high = opts.worlds
        argv = [*train_argv(cfg, nproc=opts.nproc, timeout_s=opts.timeout_s), "--elastic", "--min-nproc", str(low),
                "--max-nproc", str(high), "--log-dir", str(work / "logs")]
        for size, layout in opts.layouts:
            argv += ["--layout-for", f"{size}:{layout}"]
        for inject in opts.injects:
            argv += ["--inject", str(inject)]
        job = subprocess.run([sys.executable, "-m", "shardshift", *argv], capture_output=True, text=True,
                             timeout=opts.timeout_s * 4, preexec_fn=dies_with_this_process())
        if job.returncode != 0:
            print(f"shardshift: the elastic job exited with code {job.returncode}:\n{job.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        events = [EventRecord.from_metrics(r, *_restart(opts, cfg, r, ckpt, work))
                  for r in records if r.get("event") == "membership"]
        overhead = _redundancy_overhead(opts, work) if opts.overhead_steps else None
        report(opts, events, records, overhead)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _restart(opts: ElasticBenchOptions, cfg: TrainConfig, event: dict, ckpt: Path,
             work: Path) -> tuple[Restart | None, str | None]:
    """The restart way for one event: a fresh job of the new world from the checkpoint of its step;
    (the job, None), or (None, why it failed), or (None, None) without ``restart``."""
    if not opts.restart:
        return None, None
    resumed = dataclasses.replace(cfg.with_layout(Layout.parse(event["to"])), save=None, save_every=0, metrics=None,
                                  log_every=1)  # the restart is timed by its first step's line
    try:
        restart = restart_job(resumed, ckpt / f"step-{event['step']:08d}", event["step"], event["to_world"],
                              opts.timeout_s, work)
    except RestartFailed as err:  # a finding about the baseline: reported, not fatal
        print(err, file=sys.stderr)
        return None, err.reason
    return restart, None


def _redundancy_overhead(opts: ElasticBenchOptions, work: Path) -> RedundancyOverhead:
    """Two fixed jobs under fsdp=N, --redundancy 0 then 1: their median step times after the
    first, and the fraction of tokens/s that redundancy costs."""
    medians = {}
    for k in (0, 1):
        metrics = work / f"overhead-{k}.jsonl"
        cfg = dataclasses.replace(opts.cfg.with_layout(Layout(fsdp=opts.nproc)), steps=opts.overhead_steps,
                                  stop_at=opts.overhead_steps, save=None, save_every=0, metrics=str(metrics),
                                  resume=None)
        argv = [*train_argv(cfg, nproc=opts.nproc, timeout_s=opts.timeout_s), "--elastic", "--redundancy", str(k),
                "--log-dir", str(work / f"overhead-{k}-logs")]
        job = subprocess.run([sys.executable, "-m", "shardshift", *argv], capture_output=True, text=True,
                             timeout=opts.timeout_s * 2, preexec_fn=dies_with_this_process())
        if job.returncode != 0:
            raise RuntimeError(f"the --redundancy {k} job exited with code {job.returncode}:\n{job.stderr[-3000:]}")
        times = sorted(r["step_time_s"] for r in map(json.loads, metrics.read_text().splitlines())
                       if "step_time_s" in r and r["step"] > 1)
        medians[k] = times[len(times) // 2]
    return RedundancyOverhead(str(Layout(fsdp=opts.nproc)), opts.overhead_steps, medians[0], medians[1],
                              1 - medians[0] / medians[1])


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary(events: Sequence[EventRecord]) -> dict[str, float | None]:
    """The geometric means of the events' restart/pause ratios: joins and leaves, crashes."""
    ratios = {kinds: [e.restart_over_pause for e in events if e.kind in kinds and e.restart_over_pause]
              for kinds in (("join", "leave"), ("crash",))}
    return {"join_leave": _geomean(ratios[("join", "leave")]), "crash": _geomean(ratios[("crash",)])}


def crash_pauses(events: Sequence[EventRecord]) -> dict[str, float | int | None]:
    """The crashes' pauses: how many, their median and their maximum (None without a crash)."""
    pauses = sorted(e.pause_seconds for e in events if e.kind == "crash")
    if not pauses:
        return {"count": 0, "median": None, "max": None}
    middle = len(pauses) // 2
    median = pauses[middle] if len(pauses) % 2 else (pauses[middle - 1] + pauses[middle]) / 2
    return {"count": len(pauses), "median": median, "max": pauses[-1]}


def report(opts: ElasticBenchOptions, events: list[EventRecord], records: list[dict],
           overhead: RedundancyOverhead | None) -> None:
    """Print the events beside their restarts: one JSON object (`ElasticBenchResult`), or the table.
    `records` are the elastic job's metrics."""
    means = summary(events)
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r]
    result = ElasticBenchResult(model=opts.cfg.model.name, params=opts.cfg.model.num_params(), dtype=opts.cfg.dtype,
                                global_batch=opts.cfg.global_batch, events=tuple(events),
                                geomean_restart_over_pause=means, crash_pauses=crash_pauses(events),
                                median_step_seconds=sorted(step_times)[len(step_times) // 2], redundancy=overhead)
    if opts.json:
        print(json.dumps(result.as_dict()))
        return
    print(f"bench elastic: {opts.cfg.model.name} ({result.params:,} parameters), {opts.cfg.dtype}, global batch "
          f"{opts.cfg.global_batch}; seconds, the slowest worker's")
    print(f"{'event':<8}{'after':>6}{'worlds':>8}  {'layouts':<22}{'pause':>8}{'detect':>8}{'restart':>9}"
          f"{'rst/pause':>10}{'lost':>6}{'moved':>12}  from")
    for e in events:
        ratio = "-" if e.restart_over_pause is None else f"{e.restart_over_pause:.1f}"
        restart = "failed" if e.restart_error else ("-" if e.restart_seconds is None else f"{e.restart_seconds:.2f}")
        print(f"{e.kind:<8}{e.step:>6}{e.from_world:>4}->{e.to_world:<3} {e.before + ' -> ' + e.after:<22}"
              f"{e.pause_seconds:>8.2f}{e.detect_seconds:>8.2f}{restart:>9}{ratio:>10}{e.steps_lost:>6}"
              f"{e.bytes_moved:>12,}  {e.recovered_from}")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"geometric mean restart/pause: joins and leaves {fmt(means['join_leave'])}, crashes {fmt(means['crash'])}; "
          f"median step {result.median_step_seconds:.2f} s")
    crashes = result.crash_pauses
    if crashes["count"]:
        print(f"{crashes['count']} crash(es): pause median {crashes['median']:.2f} s, max {crashes['max']:.2f} s "
              f"(--timeout {opts.timeout_s:g} s)")
    if overhead:
        print(f"--redundancy 1 under {overhead.layout}: median step {overhead.step_seconds_redundancy_1:.2f} s "
              f"against {overhead.step_seconds:.2f} s without: {overhead.overhead:.1%} of tokens/s")
