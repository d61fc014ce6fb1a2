"""A topology named in one string (backend option, environment variable), and topologies passed
between processes as plain JSON-able dicts.

Spec strings, sized to a group of n ranks (`topology_from_spec(spec, n)`):

    full            every ordered pair linked at 1 Gbit/s (the backend's default: no measuring, and
                    every rank treated alike)
    full:RATE       the same at RATE, e.g. full:10Gbit/s or full:25e9 (bytes/s)
    ring, ring:RATE bidirectional ring in rank order
    dgx1v           the first n GPUs of a DGX-1 (V100) with the PCIe/QPI fallback
    dgx1v:0,2,3,5   those GPUs, rank i on the i-th listed (n of them)
    fat-tree        a two-level fat tree with n hosts (presets.fat_tree defaults)
    probe           measured on the running group: the caller runs probe.probe_topology
    PATH            a YAML file in the format of docs/topology.md (n ranks)

The same topology must be given to every rank: packings are computed on each rank and compared
(execution/runner.py checks a digest of every plan across ranks before it first runs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from shardshift.collectives.topology.io import load_topology, topology_from_dict
from shardshift.collectives.topology.model import Link, Topology, pair_rates
from shardshift.collectives.topology.presets import dgx1v, fat_tree, full, ring
from shardshift.units import parse_rate

PROBE = "probe"
DEFAULT_SPEC = "full"
_NAMED = ("full", "ring", "dgx1v", "fat-tree", PROBE)  # spec names, before paths
FILE = "topology file"  # how errors name a topology file given in a spec (the flag is the caller's)


def is_probe(spec: str) -> bool:
    return spec.strip().lower() == PROBE


def topology_from_spec(spec: str, num_ranks: int, flag: str = FILE) -> Topology:
    """The topology named by `spec` for a group of `num_ranks` ranks (see module docstring);
    `flag` names a topology file in its errors (the flag that gave it, where there is one)."""
    text = spec.strip()
    name, _, arg = text.partition(":")
    key = name.lower().replace("_", "-")
    if key not in _NAMED and os.path.exists(text):
        topology = load_topology(text, flag)  # its errors name the file and what it should be
    else:
        try:
            topology = _named(key, arg, text, num_ranks)
        except ValueError as err:
            raise ValueError(f"topology {spec!r}: {err}; give full[:RATE], ring[:RATE], dgx1v[:GPUS], "
                             "fat-tree, probe, or the path of a YAML topology file") from None  # fmt: skip
    if topology.num_ranks != num_ranks:
        raise ValueError(f"topology {spec!r} has {topology.num_ranks} ranks but the group has {num_ranks}; "
                         f"give one rank per group member (e.g. dgx1v:{','.join(map(str, range(num_ranks)))})")
    return topology


def _named(key: str, arg: str, text: str, num_ranks: int) -> Topology:
    """The preset `key` (with its argument `arg`) for `num_ranks` ranks."""
    if key == "full":
        return full(num_ranks, **({"bandwidth": parse_rate(arg)} if arg else {}))
    if key == "ring":
        if num_ranks < 2:
            return full(num_ranks)
        return ring(num_ranks, **({"bandwidth": parse_rate(arg)} if arg else {}))
    if key == "dgx1v":
        gpus = [int(g) for g in arg.split(",") if g.strip()] if arg else list(range(num_ranks))
        return dgx1v(gpus)
    if key == "fat-tree":
        return fat_tree(num_ranks)
    if key == PROBE:
        raise ValueError("'probe' is measured on a running group: call probe.probe_topology(group)")
    raise ValueError(f"no file {text!r}")


def hosts_topology(spec: str | None, hosts: list[str], flag: str = FILE) -> Topology:
    """The network of a world whose rank r runs on host `hosts[r]` (an elastic job's: its worlds
    change, its hosts do not). `spec` is a preset (``full[:RATE]``, ``ring[:RATE]``, sized to the
    world as usual; None: ``full``) or a YAML file whose ranks are named by host (as each worker
    publishes it: the address it reaches the coordinator from, or ``$SHARDSHIFT_HOST``). From a
    file, two ranks on different hosts are linked at the rate between their hosts (the direct link,
    else the widest path through switches: `model.pair_rates`), and ranks of one host at the
    file's fastest rate. ValueError names a host the file lacks."""
    if spec is None or not os.path.exists(spec.strip()):
        return topology_from_spec(spec or DEFAULT_SPEC, len(hosts), flag)
    network = load_topology(spec.strip(), flag)
    where = {name: i for i, name in enumerate(network.names[:network.num_ranks])}
    missing = sorted({h for h in hosts if h not in where})
    if missing:
        raise ValueError(f"{flag} {spec}: no rank named {', '.join(missing)} (a worker's host); name every host "
                         f"that may run workers: {', '.join(where)} are named")
    rates = pair_rates(network)
    local = max(link.capacity for link in network.links) if network.links else 1.0
    links = []
    for a, host_a in enumerate(hosts):
        for b, host_b in enumerate(hosts):
            rate = local if host_a == host_b else rates.get((where[host_a], where[host_b]))
            if a != b and rate:
                links.append(Link(a, b, rate))
    seen: dict[str, int] = {}
    names = []
    for host in hosts:
        names.append(f"{host}/{seen.get(host, 0)}")
        seen[host] = seen.get(host, 0) + 1
    return Topology(len(hosts), tuple(links), names=tuple(names), link_unit=network.link_unit,
                    name=f"{network.name} ({len(hosts)} workers)")


def group_topology(spec: str | Topology, global_ranks: list[int], world_size: int) -> Topology:
    """The topology of a group of the default group's ranks `global_ranks` (in group rank order):
    `spec` sized to the group (a preset, or a file or Topology of the group's size), or, from a
    file or Topology of the whole job (a DeviceMesh gives its sub-groups the job's network), the
    part of that network the group sees (`Topology.restricted`)."""
    size = len(global_ranks)
    whole = list(global_ranks) == list(range(world_size))
    if isinstance(spec, Topology):
        topology = spec
    elif whole or not os.path.exists(spec.strip()):
        return topology_from_spec(spec, size)
    else:
        topology = load_topology(spec.strip(), FILE)
    if topology.num_ranks == size:
        return topology
    if topology.num_ranks != world_size:
        raise ValueError(f"topology {topology.name} has {topology.num_ranks} ranks, but the group has {size} "
                         f"and the job {world_size}: describe the group or the whole job")
    return topology.restricted(global_ranks)


def topology_to_dict(topology: Topology) -> dict:
    """A JSON-able mapping that `topology_from_dict` (io.py) reads back to an equal
    Topology: names, links with rates in bytes/s, latencies in seconds."""
    n, names = topology.num_ranks, topology.names
    out: dict = {
        "name": topology.name,
        "ranks": list(names[:n]),
        "switches": list(names[n:]),
        "links": [{"from": names[l.src], "to": names[l.dst], "bandwidth": l.capacity,
                   "latency": l.latency} for l in topology.links],  # fmt: skip
    }
    if topology.link_unit is not None:
        out["link_unit"] = topology.link_unit
    return out


def topology_from_plain(data: Mapping) -> Topology:
    """Inverse of `topology_to_dict`."""
    return topology_from_dict(data)
