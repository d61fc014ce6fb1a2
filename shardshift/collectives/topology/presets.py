"""Named topologies: `dgx1v` (with any GPU subset), `ring`, `full`, a two-level `fat-tree`, and a
GPU `cluster` (hosts of GPUs behind an NVSwitch, NICs on rail-optimised or plain leaves, spines).

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
import math
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


def _check_rate(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r}: give a rate > 0 in bytes/s, or in YAML e.g. '400 Gbit/s'")


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r}: give seconds >= 0, or in YAML e.g. '5 us'")


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


# `cluster` defaults: an H100/H200-class host (8 GPUs, NVLink through NVSwitch, 8 x 400 Gbit/s NICs).
CLUSTER_INTRA_BANDWIDTH = 450e9  # bytes/s per GPU to its host's NVSwitch, each direction
CLUSTER_NIC_BANDWIDTH = 50e9  # bytes/s per NIC, each direction (400 Gbit/s)
CLUSTER_INTRA_LATENCY = 2e-6  # seconds per link inside a host
CLUSTER_LATENCY = 5e-6  # seconds per network link (NIC to leaf, leaf to spine)


def cluster(
    hosts: int,
    *,
    gpus_per_host: int = 8,
    intra_bandwidth: float = CLUSTER_INTRA_BANDWIDTH,
    intra_latency: float = CLUSTER_INTRA_LATENCY,
    nics_per_host: int = 8,
    nic_bandwidth: float = CLUSTER_NIC_BANDWIDTH,
    hosts_per_leaf: int = 16,
    spines: int | None = None,
    rails: bool = True,
    latency: float = CLUSTER_LATENCY,
) -> Topology:
    """A GPU cluster: `hosts` hosts of `gpus_per_host` GPUs, the GPUs being the ranks
    (rank = host * gpus_per_host + gpu).

    Inside a host every GPU links to the host's NVSwitch (a switch node; none for one GPU) at
    `intra_bandwidth` each way. GPUs and NICs pair up in proportion: GPU g uses NIC
    g * nics_per_host // gpus_per_host, and when a host has more NICs than GPUs, NIC i serves GPU
    i * gpus_per_host // nics_per_host (one GPU with 8 NICs models a host as one rank). A NIC
    serving one GPU is that GPU's link to its leaf; a NIC shared by several GPUs is a switch node
    between them and the leaf, linked to each at `nic_bandwidth` (the NIC, not PCIe, is what limits).

    Hosts form groups of `hosts_per_leaf`. With `rails` (rail-optimised), NIC i of every host of a
    group connects to that group's rail-i leaf; without, all of a host's NICs go to the group's one
    leaf (a plain fat tree). Every leaf links to every spine with a full share of its host-facing
    capacity (hosts_per_leaf NICs' worth, divided among the `spines`), so the network never blocks;
    `spines` defaults to hosts_per_leaf, and there are none when there is one leaf. Links inside a
    host take `intra_latency`, network links (NIC to leaf, leaf to spine) `latency`.
    """
    for name, value, minimum in (("hosts", hosts, 1), ("gpus_per_host", gpus_per_host, 1),
                                 ("nics_per_host", nics_per_host, 1), ("hosts_per_leaf", hosts_per_leaf, 1)):
        _check_count(name, value, minimum)
    for name, value in (("intra_bandwidth", intra_bandwidth), ("nic_bandwidth", nic_bandwidth)):
        _check_rate(name, value)
    for name, value in (("intra_latency", intra_latency), ("latency", latency)):
        _check_seconds(name, value)
    if not isinstance(rails, bool):
        raise ValueError(f"rails={rails!r}: give true (rail-optimised leaves) or false (one leaf per host group)")
    groups = -(-hosts // hosts_per_leaf)
    leaves_per_group = nics_per_host if rails else 1
    num_leaves = groups * leaves_per_group
    if spines is None:
        spines = hosts_per_leaf if num_leaves > 1 else 0
    _check_count("spines", spines, 0)
    if num_leaves > 1 and spines == 0:
        raise ValueError(f"{num_leaves} leaves need spines >= 1 to reach each other")
    net = _Network([f"h{h}.gpu{g}" for h in range(hosts) for g in range(gpus_per_host)])
    pairs = _gpu_nic_pairs(gpus_per_host, nics_per_host)
    ports = []  # per host: (node that cables NIC i to its leaf, i)
    for h in range(hosts):
        gpus = [h * gpus_per_host + g for g in range(gpus_per_host)]
        if gpus_per_host > 1:
            nvswitch = net.switch(f"h{h}.nvswitch")
            for gpu in gpus:
                net.cable(gpu, nvswitch, intra_bandwidth, intra_latency)
        if nics_per_host < gpus_per_host:  # shared NICs are nodes between their GPUs and the leaf
            nics = [net.switch(f"h{h}.nic{i}") for i in range(nics_per_host)]
            for g, i in pairs:
                net.cable(gpus[g], nics[i], nic_bandwidth, intra_latency)
            ports.append(list(zip(nics, range(nics_per_host))))
        else:
            ports.append([(gpus[g], i) for g, i in pairs])
    leaves = [[net.switch(f"leaf{group}.rail{rail}" if rails else f"leaf{group}") for rail in range(leaves_per_group)]
              for group in range(groups)]  # fmt: skip
    for h, host_ports in enumerate(ports):
        for node, i in host_ports:
            net.cable(node, leaves[h // hosts_per_leaf][i if rails else 0], nic_bandwidth, latency)
    spine_nodes = [net.switch(f"spine{k}") for k in range(spines)]
    # Non-blocking: a leaf's uplinks together carry what its hosts_per_leaf hosts' NICs can send it.
    uplink = hosts_per_leaf * nics_per_host / leaves_per_group * nic_bandwidth / max(spines, 1)
    for leaf in (leaf for group in leaves for leaf in group):
        for spine in spine_nodes:
            net.cable(leaf, spine, uplink, latency)
    kind = "rails" if rails else "fat-tree"
    return net.topology(link_unit=float(nic_bandwidth), name=f"cluster{hosts}x{gpus_per_host}-{kind}")


class _Network:
    """Nodes and links of a preset being built: ranks first, then switches in the order added.
    Cables between the same two nodes add up to one link each way (parallel links are one link)."""

    def __init__(self, rank_names: list[str]):
        self.names = list(rank_names)
        self.num_ranks = len(self.names)
        self.links: dict[tuple[int, int], list[float]] = {}  # (src, dst) -> [capacity, latency]

    def switch(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1

    def cable(self, a: int, b: int, capacity: float, latency: float) -> None:
        for pair in ((a, b), (b, a)):
            self.links.setdefault(pair, [0.0, latency])[0] += capacity

    def topology(self, link_unit: float, name: str) -> Topology:
        links = tuple(Link(a, b, cap, lat) for (a, b), (cap, lat) in sorted(self.links.items()))
        return Topology(self.num_ranks, links, len(self.names) - self.num_ranks, tuple(self.names),
                        link_unit=link_unit, name=name)  # fmt: skip


def _gpu_nic_pairs(gpus: int, nics: int) -> list[tuple[int, int]]:
    """(gpu, nic) pairs of one host, paired in proportion (see `cluster`)."""
    if nics <= gpus:
        return [(g, g * nics // gpus) for g in range(gpus)]
    return [(i * gpus // nics, i) for i in range(nics)]


PRESETS: dict[str, Callable[..., Topology]] = {
    "dgx1v": dgx1v,
    "ring": ring,
    "full": full,
    "fat-tree": fat_tree,
    "cluster": cluster,
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
