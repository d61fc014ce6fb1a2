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
leaves together and for crashes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shardshift.bench.restart import RestartFailed, restart_job
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
            raise ValueError("no events: give --suite or --inject STEP:EVENT")
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
        events = [r for r in records if r.get("event") == "membership"]
        for event in events:
            event.update(_restart(opts, cfg, event, ckpt, work))
        overhead = _redundancy_overhead(opts, work) if opts.overhead_steps else None
        report(opts, events, records, overhead)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _restart(opts: ElasticBenchOptions, cfg: TrainConfig, event: dict, ckpt: Path, work: Path) -> dict:
    """The restart way for one event: a fresh job of the new world from the checkpoint of its step."""
    out = {"restart_seconds": None, "restart_step_seconds": None, "restart_error": None}
    if not opts.restart:
        return out
    resumed = dataclasses.replace(cfg.with_layout(Layout.parse(event["to"])), save=None, save_every=0, metrics=None,
                                  log_every=1)  # the restart is timed by its first step's line
    try:
        restart = restart_job(resumed, ckpt / f"step-{event['step']:08d}", event["step"], event["to_world"],
                              opts.timeout_s, work)
    except RestartFailed as err:  # a finding about the baseline: reported, not fatal
        print(err, file=sys.stderr)
        out["restart_error"] = err.reason
        return out
    out["restart_seconds"], out["restart_step_seconds"] = restart.seconds, restart.step_seconds
    return out


def _redundancy_overhead(opts: ElasticBenchOptions, work: Path) -> dict:
    """Two fixed jobs under fsdp=N, --redundancy 0 then 1: their median step times after the
    first, and the fraction of tokens/s that redundancy costs."""
    medians = {}
    for k in (0, 1):
        metrics = work / f"overhead-{k}.jsonl"
        cfg = dataclasses.replace(opts.cfg.with_layout(Layout(fsdp=opts.nproc)), steps=opts.overhead_steps, stop_at=opts.overhead_steps,
                                  save=None, save_every=0, metrics=str(metrics), resume=None)
        argv = [*train_argv(cfg, nproc=opts.nproc, timeout_s=opts.timeout_s), "--elastic", "--redundancy", str(k),
                "--log-dir", str(work / f"overhead-{k}-logs")]
        job = subprocess.run([sys.executable, "-m", "shardshift", *argv], capture_output=True, text=True,
                             timeout=opts.timeout_s * 2, preexec_fn=dies_with_this_process())
        if job.returncode != 0:
            raise RuntimeError(f"the --redundancy {k} job exited with code {job.returncode}:\n{job.stderr[-3000:]}")
        times = sorted(r["step_time_s"] for r in map(json.loads, metrics.read_text().splitlines())
                       if "step_time_s" in r and r["step"] > 1)
        medians[k] = times[len(times) // 2]
    return {"layout": str(Layout(fsdp=opts.nproc)), "steps": opts.overhead_steps, "step_seconds": medians[0],
            "step_seconds_redundancy_1": medians[1], "overhead": 1 - medians[0] / medians[1]}


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary(events: list[dict]) -> dict:
    """Each event's restart/pause ratio, and their geometric means: joins and leaves, crashes."""
    for e in events:
        e["restart_over_pause"] = (e["restart_seconds"] / e["pause_seconds"]
                                   if e.get("restart_seconds") and e["pause_seconds"] > 0 else None)
    ratios = {kinds: [e["restart_over_pause"] for e in events if e["kind"] in kinds and e["restart_over_pause"]]
              for kinds in (("join", "leave"), ("crash",))}
    return {"join_leave": _geomean(ratios[("join", "leave")]), "crash": _geomean(ratios[("crash",)])}


def report(opts: ElasticBenchOptions, events: list[dict], records: list[dict], overhead: dict | None) -> None:
    means = summary(events)
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r]
    fields = ("kind", "step", "from_world", "to_world", "from", "to", "pause_seconds", "detect_seconds",
              "restart_seconds", "restart_step_seconds", "restart_over_pause", "steps_lost", "bytes_moved",
              "recovered_from", "planned_ahead", "restart_error", "phases")
    out = {"model": opts.cfg.model.name, "params": opts.cfg.model.num_params(), "dtype": opts.cfg.dtype,
           "global_batch": opts.cfg.global_batch, "events": [{k: e.get(k) for k in fields} for e in events],
           "geomean_restart_over_pause": means, "median_step_seconds": sorted(step_times)[len(step_times) // 2],
           "redundancy_overhead": overhead["overhead"] if overhead else None, "redundancy": overhead}
    if opts.json:
        print(json.dumps(out))
        return
    print(f"bench elastic: {opts.cfg.model.name} ({out['params']:,} parameters), {opts.cfg.dtype}, global batch "
          f"{opts.cfg.global_batch}; seconds, the slowest worker's")
    print(f"{'event':<8}{'after':>6}{'worlds':>8}  {'layouts':<22}{'pause':>8}{'detect':>8}{'restart':>9}"
          f"{'rst/pause':>10}{'lost':>6}{'moved':>12}  from")
    for e in events:
        ratio = "-" if e["restart_over_pause"] is None else f"{e['restart_over_pause']:.1f}"
        restart = "failed" if e.get("restart_error") else ("-" if e["restart_seconds"] is None
                                                           else f"{e['restart_seconds']:.2f}")
        print(f"{e['kind']:<8}{e['step']:>6}{e['from_world']:>4}->{e['to_world']:<3} {e['from'] + ' -> ' + e['to']:<22}"
              f"{e['pause_seconds']:>8.2f}{e['detect_seconds']:>8.2f}{restart:>9}{ratio:>10}{e['steps_lost']:>6}"
              f"{e['bytes_moved']:>12,}  {e['recovered_from']}")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"geometric mean restart/pause: joins and leaves {fmt(means['join_leave'])}, crashes {fmt(means['crash'])}; "
          f"median step {out['median_step_seconds']:.2f} s")
    if overhead:
        print(f"--redundancy 1 under {overhead['layout']}: median step {overhead['step_seconds_redundancy_1']:.2f} s "
              f"against {overhead['step_seconds']:.2f} s without: {overhead['overhead']:.1%} of tokens/s")
