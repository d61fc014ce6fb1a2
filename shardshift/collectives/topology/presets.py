"""Named topologies: `dgx1v` (with any GPU subset), `ring`, `full`, and a two-level `fat-tree`.

Every preset returns a `Topology` whose compute ranks are numbered 0..k-1; for `dgx1v` the ranks
follow the order of the `gpus` argument (rank i is GPU gpus[i]), and the node names keep the
physical GPU numbers ("gpu4").

The DGX-1 (V100) NVLink graph (docs/background.md §2, `nvidia-smi` numbering) has one NVLink of 25 GB/s
per direction on eight pairs and two on eight more (50 GB/s); the other twelve pairs have no NVLink.
Those pairs talk over PCIe and the CPUs' QPI link. We model that fallback as **one switch node,
"pcie"**, with a 10 GB/s link each way between it and every GPU: all of a GPU's PCIe traffic shares
that 10 GB/s, and any GPU can reach any other through it. It is a simplification (the real machine
has two PCIe trees joined by QPI), chosen because it is symmetric (the switch has equal in- and
out-capacity on every port, which the packing's optimality argument needs) and easy to read.
`pcie=False` leaves it out, giving the NVLink-only graph on which the worked values of docs/background.md §2 are
stated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from shardshift.collectives.topology.model import Link, Topology

NVLINK_BANDWIDTH = 25e9  # bytes/s per NVLink per direction (V100)
PCIE_BANDWIDTH = 10e9  # bytes/s per GPU to the PCIe/QPI fallback, each direction
NVLINK_LATENCY = 1e-6  # seconds, nominal
PCIE_LATENCY = 2e-6  # seconds, nominal, per hop (GPU→switch or switch→GPU)

# (gpu a, gpu b, number of NVLinks between them), nvidia-smi numbering.
DGX1V_NVLINKS = (
    (0, 3, 2), (0, 4, 2), (1, 2, 2), (1, 5, 2), (2, 3, 2), (4, 7, 2), (5, 6, 2), (6, 7, 2),
    (0, 1, 1), (0, 2, 1), (1, 3, 1), (2, 6, 1), (3, 7, 1), (4, 5, 1), (4, 6, 1), (5, 7, 1),
)  # fmt: skip


def dgx1v(
    gpus: Sequence[int] | None = None,
    *,
    pcie: bool = True,
    nvlink_bandwidth: float = NVLINK_BANDWIDTH,
    pcie_bandwidth: float = PCIE_BANDWIDTH,
) -> Topology:
    """A DGX-1 (V100) restricted to `gpus` (default all eight), ranks renumbered in the given order.

    `pcie=True` adds the PCIe/QPI fallback switch described in the module docstring.
    """
    gpus = list(range(8)) if gpus is None else list(gpus)
    if not gpus:
        raise ValueError("gpus is empty; give at least one DGX-1 GPU number (0..7)")
    for g in gpus:
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= 7:
            raise ValueError(f"gpu {g!r} is not a DGX-1 GPU; choose GPU numbers from 0..7")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus {gpus} repeats a GPU; list each GPU once")
    rank_of = {g: r for r, g in enumerate(gpus)}
    links = []
    for a, b, count in DGX1V_NVLINKS:
        if a in rank_of and b in rank_of:
            cap = count * nvlink_bandwidth
            links.append(Link(rank_of[a], rank_of[b], cap, NVLINK_LATENCY))
            links.append(Link(rank_of[b], rank_of[a], cap, NVLINK_LATENCY))
    links.sort(key=lambda l: (l.src, l.dst))
    names = [f"gpu{g}" for g in gpus]
    num_switches = 0
    if pcie:
        switch = len(gpus)
        for r in range(len(gpus)):
            links.append(Link(r, switch, pcie_bandwidth, PCIE_LATENCY))
            links.append(Link(switch, r, pcie_bandwidth, PCIE_LATENCY))
        names.append("pcie")
        num_switches = 1
    label = ",".join(map(str, gpus))
    return Topology(
        len(gpus),
        tuple(links),
        num_switches,
        tuple(names),
        link_unit=nvlink_bandwidth,
        name=f"dgx1v[{label}]" + ("" if pcie else " nvlink-only"),
    )


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: give an int >= {minimum}")


def ring(n: int, *, bandwidth: float = 125e6, latency: float = 0.0, bidirectional: bool = True) -> Topology:
    """n ranks in a ring: i→i+1 (and i+1→i when bidirectional), each link `bandwidth` bytes/s.

    Default 125e6 bytes/s (1 Gbit/s), inside the range link emulation handles reliably.
    """
    _check_count("n", n, 2)
    pairs = {(i, (i + 1) % n) for i in range(n)}
    if bidirectional:
        pairs |= {(b, a) for a, b in pairs}
    links = tuple(Link(a, b, bandwidth, latency) for a, b in sorted(pairs))
    kind = "ring" if bidirectional else "uniring"
    return Topology(n, links, link_unit=float(bandwidth), name=f"{kind}{n}")


def full(n: int, *, bandwidth: float = 125e6, latency: float = 0.0) -> Topology:
    """n ranks, a link of `bandwidth` bytes/s between every ordered pair (default 1 Gbit/s)."""
    _check_count("n", n, 1)
    links = tuple(Link(a, b, bandwidth, latency) for a in range(n) for b in range(n) if a != b)
    return Topology(n, links, link_unit=float(bandwidth), name=f"full{n}")


def fat_tree(
    hosts: int,
    *,
    hosts_per_leaf: int = 8,
    spines: int | None = None,
    host_bandwidth: float = 12.5e9,
    uplink_bandwidth: float | None = None,
    latency: float = 1e-6,
) -> Topology:
    """A two-level fat tree: hosts under leaf switches, every leaf linked to every spine switch.

    Hosts are ranks 0..hosts-1, `hosts_per_leaf` to a leaf (the last leaf may have fewer); leaves
    come next, then spines. Each host↔leaf link carries `host_bandwidth` bytes/s each way (default
    12.5e9, 100 Gbit/s); each leaf↔spine link `uplink_bandwidth` (default: host_bandwidth). With
    the default `spines=hosts_per_leaf` the tree is non-blocking. When every host fits under one
    leaf there are no spines (a single switch).
    """
    _check_count("hosts", hosts, 1)
    _check_count("hosts_per_leaf", hosts_per_leaf, 1)
    num_leaves = -(-hosts // hosts_per_leaf)
    if spines is None:
        spines = hosts_per_leaf if num_leaves > 1 else 0
    _check_count("spines", spines, 0)
    if num_leaves > 1 and spines == 0:
        raise ValueError(f"{num_leaves} leaves need spines >= 1 to reach each other")
    uplink = host_bandwidth if uplink_bandwidth is None else uplink_bandwidth
    leaf0, spine0 = hosts, hosts + num_leaves
    links = []
    for h in range(hosts):
        leaf = leaf0 + h // hosts_per_leaf
        links += [Link(h, leaf, host_bandwidth, latency), Link(leaf, h, host_bandwidth, latency)]
    for leaf in range(leaf0, spine0):
        for spine in range(spine0, spine0 + spines):
            links += [Link(leaf, spine, uplink, latency), Link(spine, leaf, uplink, latency)]
    names = [f"h{h}" for h in range(hosts)]
    names += [f"leaf{i}" for i in range(num_leaves)] + [f"spine{i}" for i in range(spines)]
    return Topology(
        hosts,
        tuple(links),
        num_leaves + spines,
        tuple(names),
        link_unit=float(host_bandwidth),
        name=f"fat-tree{hosts}",
    )


PRESETS: dict[str, Callable[..., Topology]] = {
    "dgx1v": dgx1v,
    "ring": ring,
    "full": full,
    "fat-tree": fat_tree,
}


def preset(name: str, **params) -> Topology:
    """Build a preset by name; `params` are the keyword arguments of its function.

    `ring`, `full` take their size as `n`; `fat-tree` as `hosts`; `dgx1v` takes `gpus`.
    """
    key = name.replace("_", "-").lower()
    if key not in PRESETS:
        raise ValueError(f"unknown topology preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        return PRESETS[key](**params)
    except TypeError as exc:  # a wrong keyword: say which ones exist
        allowed = ", ".join(inspect.signature(PRESETS[key]).parameters)
        raise ValueError(f"preset {key}: {exc}; its parameters are {allowed}") from None
