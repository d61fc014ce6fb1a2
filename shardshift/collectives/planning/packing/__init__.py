"""Tree packing: weighted spanning trees whose rates reach a collective's bound on a topology.

`pack` (pack.py) chooses among constructions and depths; the problem statement and column
pricing are in problem.py, the exact solver (LP with column generation) in lp.py, the
multiplicative-weights approximation for large topologies in mwu.py.
"""

from shardshift.collectives.planning.packing.pack import Depth, Method, PackOptions, describe, pack

__all__ = ["Depth", "Method", "PackOptions", "describe", "pack"]
