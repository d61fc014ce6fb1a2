"""Link emulation on one machine: a test and benchmark harness, not part of the library's data path.

N ranks run in network namespaces of their own, every ordered pair of ranks shaped with tc to
its own rate (`network.py`: build, run, measure, tear down; `shaping.py`: the pure plan of
namespaces, addresses and tc classes; `processes.py`: commands and the teardown registry;
`topology.py`: the pair rates that emulate a collectives `Topology`). The command line is
``python -m shardshift.netemu`` (`cli.py`).
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "EmulatedNetwork": ".network", "PairMeasurement": ".network", "netns_unavailable_reason": ".network",
    "cleanup_stale": ".processes", "list_namespaces": ".processes",
    "RANK_IFNAME": ".shaping", "uniform_rates": ".shaping",
    "auto_scale": ".topology", "emulation_rates": ".topology", "scaled": ".topology",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
