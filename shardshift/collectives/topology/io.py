"""Reading topologies from YAML (format: docs/topology.md); rates and durations as in `shardshift.units`.

Two forms of file:

    preset: dgx1v            # a named preset and its parameters (keys ending in "bandwidth"
    gpus: [0, 1, 2, 3]       # are rates, keys ending in "latency" durations)
    pcie: false

    name: lab                # or nodes and links spelled out
    ranks: 4                 # a count, or a list of rank names
    switches: [tor]          # optional
    link_unit: 1 Gbit/s      # optional
    latency: 5 us            # optional default for links
    links:
      - {between: [0, 1], bandwidth: 1 Gbit/s}          # both directions
      - {from: 2, to: tor, bandwidth: 200 Mbit/s, latency: 20 us}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shardshift.collectives.topology.model import Link, Topology
from shardshift.collectives.topology.presets import PRESETS, preset
from shardshift.textfile import naming, read_yaml
from shardshift.units import parse_duration, parse_rate

TOPOLOGY_FILE = "a YAML topology file (docs/topology.md)"  # what --topology names, for messages


def load_topology(path: str | Path, flag: str | None = "--topology") -> Topology:
    """Read a topology YAML file (see docs/topology.md); ValueError in one line naming `flag` and
    the file (`shardshift.textfile`), or what in it is wrong."""
    data = read_yaml(path, flag, TOPOLOGY_FILE)
    try:
        return topology_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{naming(flag, path)}: {exc}") from None


def topology_from_dict(data: Mapping) -> Topology:
    """Build a topology from the parsed YAML mapping (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise ValueError("the top level must be a mapping with 'preset' or 'ranks' and 'links'")
    if "preset" in data:
        params = {k: v for k, v in data.items() if k != "preset"}
        for key, value in params.items():  # rates and durations may be written with units
            if key.endswith("bandwidth"):
                params[key] = parse_rate(value)
            elif key.endswith("latency"):
                params[key] = parse_duration(value)
        name = str(data["preset"])
        if name.replace("_", "-").lower() not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return preset(name, **params)
    allowed = {"version", "name", "ranks", "switches", "links", "link_unit", "latency"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; allowed keys are {sorted(allowed)} or 'preset'")
    if data.get("version", 1) != 1:
        raise ValueError(f"version {data['version']!r} is not supported; this reader reads version 1")
    if "ranks" not in data or "links" not in data:
        raise ValueError("give 'ranks' (a count or a list of names) and 'links'")
    ranks = data["ranks"]
    if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1:
        rank_names = [str(r) for r in range(ranks)]
    elif isinstance(ranks, list) and ranks:
        rank_names = [str(r) for r in ranks]
    else:
        raise ValueError(f"ranks={ranks!r}: give a count >= 1 or a non-empty list of names")
    switch_names = [str(s) for s in data.get("switches") or []]
    names = rank_names + switch_names
    node_of = {name: i for i, name in enumerate(names)}
    if len(node_of) != len(names):
        raise ValueError(f"rank and switch names must be distinct, got {names}")
    default_latency = parse_duration(data.get("latency", 0.0))
    links: list[Link] = []
    for i, entry in enumerate(data["links"] or []):
        links += _parse_link(i, entry, node_of, len(rank_names), default_latency)
    link_unit = data.get("link_unit")
    return Topology(
        len(rank_names),
        tuple(links),
        len(switch_names),
        tuple(names),
        link_unit=None if link_unit is None else parse_rate(link_unit),
        name=str(data.get("name", "custom")),
    )


def _parse_link(
    i: int, entry: Mapping, node_of: dict[str, int], num_ranks: int, default_latency: float
) -> list[Link]:
    """One `links:` entry → one link (from/to) or two (between)."""
    where = f"links[{i}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a mapping like {{from: 0, to: 1, bandwidth: 1 Gbit/s}}")
    keys = set(entry)
    allowed = {"from", "to", "between", "bandwidth", "latency"}
    if keys - allowed:
        raise ValueError(f"{where}: unknown keys {sorted(keys - allowed)}; allowed {sorted(allowed)}")
    if "bandwidth" not in entry:
        raise ValueError(f"{where}: give a bandwidth, e.g. bandwidth: 1 Gbit/s")
    capacity = parse_rate(entry["bandwidth"])
    latency = parse_duration(entry.get("latency", default_latency))
    if "between" in entry:
        if keys & {"from", "to"}:
            raise ValueError(f"{where}: use either 'between: [a, b]' or 'from' and 'to', not both")
        pair = entry["between"]
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}: between must list two nodes, e.g. between: [0, 1]")
        a, b = (_node(where, x, node_of, num_ranks) for x in pair)
        return [Link(a, b, capacity, latency), Link(b, a, capacity, latency)]
    if not {"from", "to"} <= keys:
        raise ValueError(f"{where}: give 'from' and 'to' (one direction) or 'between' (both)")
    a = _node(where, entry["from"], node_of, num_ranks)
    b = _node(where, entry["to"], node_of, num_ranks)
    return [Link(a, b, capacity, latency)]


def _node(where: str, ref, node_of: dict[str, int], num_ranks: int) -> int:
    """A node reference: a rank number (int) or a rank or switch name."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        if 0 <= ref < num_ranks:
            return ref
        raise ValueError(f"{where}: rank {ref} is out of range; ranks are 0..{num_ranks - 1}")
    if str(ref) in node_of:
        return node_of[str(ref)]
    raise ValueError(f"{where}: unknown node {ref!r}; known nodes are {sorted(node_of)}")
