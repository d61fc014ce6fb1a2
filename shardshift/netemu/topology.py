"""From a Topology to the per-pair rates of an emulated network (network.py), with a rate scale.

Link emulation shapes every ordered pair of ranks to its own rate, so a topology is emulated by
its point-to-point pair rates (`topology.pair_rates`): the direct link's capacity, or the widest
path through switches. Two things do not carry over, by construction of per-pair shaping:
  - links shared by several pairs through a switch are not shared in the emulation (each pair
    gets the path's full rate), so the emulated network is at least as fast as the topology and
    its bounds stay valid upper bounds only for the topology's own plans;
  - pairs with no route except through other ranks have no rate in the topology; they get
    `fill` (default: the slowest emulated rate), since every pair must be shaped.

Topologies are often in GB/s (a DGX-1) while emulation is accurate only between 100 Mbit/s and
2 Gbit/s per pair (docs/background.md §4). `scale` multiplies every rate; `auto_scale` maps the fastest
pair to 1 Gbit/s, which keeps a 10:1 spread of rates inside the accurate range. A benchmark run on
the emulated network then measures rates `scale` times the topology's: divide by `scale` to read
them in the topology's units, or run on `scaled(topology, scale)`, the topology the emulated
network actually is (what bench does: its packings are the same up to the factor, and its rates
are what the executor's pipeline depth is computed from).
"""

from __future__ import annotations

import warnings

from shardshift.collectives.topology.model import Link, Topology, pair_rates

EMULATION_MIN = 100e6 / 8  # bytes/s: below, shaping is inaccurate here (docs/background.md §4)
EMULATION_MAX = 2e9 / 8  # bytes/s: above, the 2 cores here cannot keep up
AUTO_TARGET = 1e9 / 8  # bytes/s: the fastest pair under auto_scale


def auto_scale(topology: Topology, target: float = AUTO_TARGET) -> float:
    """The factor that maps the fastest pair rate of `topology` to `target` bytes/s."""
    rates = pair_rates(topology)
    if not rates:
        raise ValueError(f"{topology.name}: no two ranks are connected; nothing to emulate")
    return target / max(rates.values())


def emulation_rates(topology: Topology, scale: float, fill: float | None = None,
                    ) -> dict[tuple[int, int], float]:
    """Payload rate in bytes/s for every ordered pair of ranks: pair rate × scale (see module doc).
    Warns when a rate falls outside the range this machine shapes accurately."""
    if not scale > 0:
        raise ValueError(f"scale={scale}: give a factor > 0 (e.g. auto_scale(topology))")
    n = topology.num_ranks
    rates = {pair: rate * scale for pair, rate in pair_rates(topology).items()}
    if not rates:
        raise ValueError(f"{topology.name}: no two ranks are connected; nothing to emulate")
    fill = min(rates.values()) if fill is None else fill
    out = {(u, v): rates.get((u, v), fill) for u in range(n) for v in range(n) if u != v}
    low, high = min(out.values()), max(out.values())
    if low < EMULATION_MIN * 0.999 or high > EMULATION_MAX * 1.001:
        warnings.warn(
            f"emulated pair rates span {low * 8 / 1e6:.0f}-{high * 8 / 1e6:.0f} Mbit/s, outside the "
            f"100-2000 Mbit/s that this machine shapes accurately; pick another scale "
            f"(auto maps the fastest pair to 1 Gbit/s)", stacklevel=2)
    return out


def scaled(topology: Topology, scale: float) -> Topology:
    """The same topology with every link's capacity multiplied by `scale` (names kept)."""
    if not scale > 0:
        raise ValueError(f"scale={scale}: give a factor > 0")
    links = tuple(Link(l.src, l.dst, l.capacity * scale, l.latency) for l in topology.links)
    unit = topology.link_unit * scale if topology.link_unit is not None else None
    return Topology(topology.num_ranks, links, topology.num_switches, topology.names, unit, topology.name)
