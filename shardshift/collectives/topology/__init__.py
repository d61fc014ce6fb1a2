"""The network a collective runs on: the model (nodes, directed links), named presets, YAML files,
one-string specs, and probing a running group (probe.py, which needs torch)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "Link": ".model", "Topology": ".model", "pair_rates": ".model",
    "dgx1v": ".presets", "fat_tree": ".presets", "full": ".presets", "preset": ".presets", "ring": ".presets",
    "load_topology": ".io", "topology_from_dict": ".io",
    "topology_from_spec": ".spec", "topology_to_dict": ".spec",
    "probe_topology": ".probe",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
