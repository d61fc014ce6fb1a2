"""`shardshift bench collectives`: gloo's own collective, a ring and ShardShift's packed trees, side by
side in one run, nccl-tests style.

    shardshift bench collectives --op allreduce --sizes 1M:64M --nproc 4
    shardshift bench collectives --op broadcast --sizes 16M:64M --topology lab.yaml --emulate --json
    shardshift bench collectives --op allgather --preset dgx1v --gpus 0,1,2,3,4 --emulate

Rows: size (bytes), count (elements), type, redop, root, impl, time (us, median over `iters` of
the slowest rank), algbw (GB/s, 1e9 bytes; for all-gather and reduce-scatter the whole gathered
buffer), busbw (algbw × 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for
broadcast and reduce), #wrong (elements that differ from the locally computed result, summed over
ranks and runs), the bound of the topology (planning/bounds.py) where one is given, and cpu: the
share of the host's CPUs busy during the timed calls (rank 0's host, from /proc/stat). Emulated
ranks share one host: where cpu is near 1, the CPUs, not the links, set the times.

  gloo   torch.distributed's own collective on the gloo group
  ring   the ring algorithm (planning/rings.py) on the best ring of the topology, run by the tree executor
  trees  the packed trees (planning/packing) run by the tree executor
  auto   the shardshift backend with algorithm="auto" (picks trees or gloo per size by timing both)

Without a topology the trees are packed on a uniform `full` topology and no bound is printed.
`emulate` runs the ranks in network namespaces (`shardshift.netemu`) whose every ordered pair is
shaped to the topology's pair rate × `emulate_scale` (`auto` maps the fastest pair to 1 Gbit/s,
the middle of the range shaped accurately on one machine, docs/background.md); the ranks then plan
on the scaled topology, the network they really run on, and bounds are in emulated units. `probe`
packs ring and trees on the topology the ranks measure when they start and prints that
topology's bound. Without emulation the ranks talk over loopback: CPU-bound and noisy, compare
ratios only.

The ranks are started by `shardshift.launch` (inside the emulated network when there is one) and
run `collectives_rank.py`; rank 0 prints the table.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.topology.model import Topology
from shardshift.plots.canvas import check_drawable

if TYPE_CHECKING:  # the launcher process does not import torch for it
    from shardshift.collectives.execution.runner import RunOptions

IMPLS = ("gloo", "ring", "trees", "auto")
DTYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
REDOPS = ("sum", "product", "min", "max", "avg")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectivesBenchOptions:
    """What `shardshift bench collectives` runs; validated when built (ValueError says what to change)."""

    op: Collective
    sizes: tuple[int, ...]  # bytes per buffer, one row per size and impl
    nproc: int
    topology: Topology | None  # planned on (scaled to the emulated network); None: `full`, no bound
    impls: tuple[str, ...] = IMPLS
    root: int = 0  # broadcast and reduce
    dtype: str = "float32"
    redop: str = "sum"
    iters: int = 3  # timed rounds per size; the median is reported
    run: RunOptions  # the tree executor's knobs
    emulate: bool = False  # run the ranks on emulated links
    emulate_scale: float = 1.0  # emulated rate / topology rate (`topology` is already scaled)
    tcp_slow_start_after_idle: bool = False  # emulation: keep the kernel's TCP default
    probe: bool = False  # pack on the topology the ranks measure when they start
    timeout_s: float = 600.0  # the whole run
    json: bool = False
    plot: Path | None = None  # rank 0 draws the rows here (a PNG) once the run is over

    def __post_init__(self) -> None:
        if not self.impls or set(self.impls) - set(IMPLS):
            raise ValueError(f"--impls {','.join(self.impls)!r}: choose from {', '.join(IMPLS)}")
        if self.nproc < 2:
            raise ValueError(f"{self.nproc} rank: a collective benchmark needs at least 2")
        if self.topology is not None and self.topology.num_ranks != self.nproc:
            raise ValueError(f"--nproc {self.nproc} but the topology has {self.topology.num_ranks} ranks; "
                             "drop --nproc or give a matching topology")
        if self.emulate and self.topology is None:
            raise ValueError("--emulate needs a topology to shape the links (--preset or --topology)")
        if self.op.rooted and not 0 <= self.root < self.nproc:
            raise ValueError(f"--root {self.root} is not a rank; choose one of 0..{self.nproc - 1}")
        if self.dtype not in DTYPES or self.redop not in REDOPS:
            raise ValueError(f"--dtype {self.dtype} --redop {self.redop}: choose a dtype of "
                             f"{', '.join(DTYPES)} and a redop of {', '.join(REDOPS)}")
        if self.iters < 1:
            raise ValueError("--iters must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s} must be > 0 seconds")
        if self.plot is not None:
            check_drawable(self.plot, "--plot")

    @property
    def bound(self) -> float | None:
        """The topology's bound for the op, algbw in bytes/s (None without a topology)."""
        from shardshift.collectives.planning.bounds import collective_bound  # scipy: not at parse time

        return None if self.topology is None else collective_bound(self.topology, self.op, self.root)


def run(opts: CollectivesBenchOptions, argv: Sequence[str]) -> int:
    """Start the ranks, each running ``shardshift <argv>`` (which leads to `collectives_rank.run`),
    on loopback or inside an emulated network; return the job's exit status."""
    from shardshift.launch import launch

    if not opts.emulate:
        return launch(opts.nproc, argv, preload=("shardshift.bench.collectives_rank",), timeout_s=opts.timeout_s)
    from shardshift.netemu import EmulatedNetwork, emulation_rates, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        raise ValueError(f"--emulate: {reason}")
    rates = emulation_rates(opts.topology, 1.0)  # the topology is the emulated network already
    with EmulatedNetwork(rates, opts.nproc, slow_start_after_idle=opts.tcp_slow_start_after_idle) as net:
        return launch(opts.nproc, argv, spawn=net.spawn, timeout_s=opts.timeout_s)


def rows(opts: CollectivesBenchOptions, measured: list[dict], bound: float | None) -> list[dict]:
    """The report's rows from what the ranks measured (see the module docstring)."""
    op, n = opts.op, opts.nproc
    out = []
    for r in measured:
        algbw = r["bytes"] / r["seconds"] / 1e9
        row = {
            "op": op.value, "bytes": r["bytes"], "count": r["count"], "type": opts.dtype,
            "redop": opts.redop if op in (Collective.REDUCE, Collective.ALLREDUCE, Collective.REDUCESCATTER) else None,
            "root": opts.root if op.rooted else None, "impl": r["impl"], "time_us": r["seconds"] * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * op.busbw_factor(n), "wrong": r["wrong"],
            "times_us": [t * 1e6 for t in r["all_seconds"]], "num_trees": r["num_trees"],
            "plan_algbw_gbps": r["packing_rate"] / 1e9 if r["packing_rate"] else None,
            "nproc": n, "emulate_scale": opts.emulate_scale if opts.emulate else None, "cpu_busy": r["cpu_busy"],
        }  # fmt: skip
        if "picked" in r:
            row["picked"] = r["picked"]  # auto: what the backend chose for this size
        if bound is not None:
            row["bound_algbw_gbps"] = bound / 1e9
            row["of_bound"] = algbw / row["bound_algbw_gbps"]
        out.append(row)
    return out


def report(opts: CollectivesBenchOptions, table: list[dict], probed: Topology | None) -> dict:
    """Print the rows: one JSON object, or the table. Returns that object (what ``--json`` prints)."""
    result = {"rows": table}
    if opts.json:
        print(json.dumps(result), flush=True)
        return result
    if probed is not None:
        print("# probed pair rates (GB/s): " + ", ".join(
            f"{link.src}->{link.dst} {link.capacity / 1e9:.3f}" for link in probed.links))
    n = opts.nproc
    where = opts.topology.name if opts.topology is not None else (
        "the probed topology" if opts.probe else f"no topology (trees on full{n})")
    print(f"# {opts.op.value} on {where}, {n} ranks"
          + (f", emulated links at {opts.emulate_scale:.4g} × the topology's rates" if opts.emulate else ", loopback"))
    head = (f"{'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'root':>4} {'impl':>6} "
            f"{'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>6} {'bound':>8} {'of bound':>8} {'vs gloo':>7} {'cpu':>5}")
    print(head)
    gloo = {r["bytes"]: r["time_us"] for r in table if r["impl"] == "gloo"}
    for r in table:
        bound = f"{r['bound_algbw_gbps']:8.4f} {r['of_bound']:8.3f}" if "bound_algbw_gbps" in r else f"{'-':>8} {'-':>8}"
        speedup = f"{gloo[r['bytes']] / r['time_us']:7.2f}" if r["bytes"] in gloo else f"{'-':>7}"
        cpu = f"{r['cpu_busy']:5.2f}" if r["cpu_busy"] is not None else f"{'-':>5}"
        print(f"{r['bytes']:>10} {r['count']:>10} {r['type']:>8} {r['redop'] or '-':>6} "
              f"{'-' if r['root'] is None else r['root']:>4} {r['impl']:>6} {r['time_us']:11.1f} "
              f"{r['algbw_gbps']:8.4f} {r['busbw_gbps']:8.4f} {r['wrong']:>6} {bound} {speedup} {cpu}")  # fmt: skip
    picks = [f"{r['bytes']}: {r['picked']}" for r in table if r.get("picked")]
    if picks:
        print("# auto picked " + ", ".join(picks))
    print("# algbw, busbw, bound: GB/s (1e9 bytes/s); vs gloo: gloo's time / this time")
    print("# cpu: share of this host's CPUs busy during the timed calls; near 1 the CPUs, not the "
          "links, set the times", flush=True)
    return result
