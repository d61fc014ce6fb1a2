"""Measure the point-to-point bandwidth between every ordered pair of ranks of a running group, and
build a Topology from it (what Blink does before packing).

    rates = probe_rates(group)            # (n, n) bytes/s, the same array on every rank
    topology = probe_topology(group)      # one link per ordered pair, rates snapped (below)

How a pair is measured: the ordered pairs are run in rounds; each round is a matching (every rank
in at most one pair), so a measurement is alone on its ranks' links. Within a pair the receiver
leads: it sends a small token naming a size, the sender answers with that many bytes, and the
receiver times from the token to the last byte. It starts at `start_bytes` and grows the size until
one transfer takes at least `min_seconds` (bandwidth-bound, not latency-bound) or reaches
`max_bytes`, then keeps that last rate. Rounds are separated by a one-element all-reduce, every wait
is bounded by the time left of `timeout_s` (`shardshift.comm`), and the rates are all-gathered so
that every rank holds the same matrix (and so builds the same topology and the same packings).

Snapping: measurements of equal links differ by a few percent, and a packing would chase that
noise with extra trees. `snap_rates` groups rates within `snap` (default 10%) of the fastest rate
of their group and gives the group its median.

Cost: 2(n-1) rounds (2n for odd n), each about `min_seconds` times the number of sizes tried:
about a second for 4 ranks on 1 Gbit/s links.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from shardshift.collectives.topology.model import Link, Topology
from shardshift.comm.p2p import Deadline, Transport

START_BYTES = 256 * 1024
MAX_BYTES = 64 * 1024 * 1024
MIN_SECONDS = 0.05  # transfers of >= 50 ms are bandwidth-bound on emulated links (docs/background.md)
_TAG = 7


def matching_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every ordered pair (src, dst) of ranks 0..n-1 once, in rounds where no rank appears twice
    (the circle method for the unordered pairs, each round once per direction)."""
    if n < 2:
        return []
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        rounds.append([(a, b) for a, b in pairs])
        rounds.append([(b, a) for a, b in pairs])
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def snap_rates(rates: np.ndarray, snap: float = 0.1) -> np.ndarray:
    """Rates within `snap` of the fastest of their group get the group's median (0s stay 0)."""
    out = np.zeros_like(rates, dtype=float)
    positive = sorted(((float(r), idx) for idx, r in np.ndenumerate(rates) if r > 0), reverse=True)
    i = 0
    while i < len(positive):
        j = i
        while j < len(positive) and positive[j][0] >= positive[i][0] * (1 - snap):
            j += 1
        value = float(np.median([r for r, _ in positive[i:j]]))
        for _, idx in positive[i:j]:
            out[idx] = value
        i = j
    return out


def probe_rates(group, *, min_seconds: float = MIN_SECONDS, start_bytes: int = START_BYTES,
                max_bytes: int = MAX_BYTES, timeout_s: float = 120.0,
                device: torch.device | str = "cpu") -> np.ndarray:
    """rates[src, dst] in bytes/s for every ordered pair of `group`'s ranks (0 on the diagonal).
    Every rank must call it; all get the same array. `group` has torch's send / recv / allreduce /
    allgather methods (a ProcessGroup or a backend such as ProcessGroupGloo)."""
    if not (0 < min_seconds and 0 < start_bytes <= max_bytes):
        raise ValueError(f"need min_seconds > 0 and 0 < start_bytes <= max_bytes, got {min_seconds}, "
                         f"{start_bytes}, {max_bytes}")  # fmt: skip
    transport = Transport(group)
    rank, n = transport.rank, transport.size
    deadline = Deadline.after(timeout_s)
    incoming = torch.zeros(n, dtype=torch.float64)  # rates into this rank, by source
    payload = torch.empty(max_bytes, dtype=torch.uint8, device=device)
    token = torch.zeros(1, dtype=torch.int64, device=device)
    sync = torch.zeros(1, device=device)
    for pairs in matching_rounds(n):
        for src, dst in pairs:
            if rank == dst:
                incoming[src] = _receive(transport, src, payload, token, min_seconds, start_bytes,
                                         max_bytes, deadline)  # fmt: skip
            elif rank == src:
                _serve(transport, dst, payload, token, deadline)
        transport.wait(group.allreduce([sync]), deadline, None, "probing: the end of a round")
    gathered = [torch.zeros(n, dtype=torch.float64, device=device) for _ in range(n)]
    transport.wait(group.allgather([gathered], [incoming.to(device)]), deadline, None, "probing: the results")
    rates = torch.stack([g.cpu() for g in gathered]).numpy()  # rates[dst, src]
    return np.ascontiguousarray(rates.T)


def probe_topology(group, *, snap: float = 0.1, **probe_options) -> Topology:
    """A Topology with one link per ordered pair at its probed rate, snapped (module docstring)."""
    rates = snap_rates(probe_rates(group, **probe_options), snap)
    n = rates.shape[0]
    links = tuple(Link(u, v, float(rates[u, v])) for u in range(n) for v in range(n) if u != v and rates[u, v] > 0)
    fastest = float(rates.max()) if n > 1 else None
    return Topology(n, links, link_unit=fastest or None, name=f"probed{n}")


def _receive(transport: Transport, src: int, payload, token, min_seconds, size, max_bytes,
             deadline: Deadline) -> float:
    """Lead one pair's measurement from the receiving side; returns bytes/s."""
    while True:
        token.fill_(size)
        start = time.perf_counter()
        transport.wait(transport.send(token, src, _TAG), deadline, src, f"probing: asking for {size} bytes")
        transport.wait(transport.recv(payload[:size], src, _TAG), deadline, src, f"probing: {size} bytes")
        seconds = time.perf_counter() - start
        if seconds >= min_seconds or size >= max_bytes:
            token.fill_(0)  # done with this pair
            transport.wait(transport.send(token, src, _TAG), deadline, src, "probing: releasing the sender")
            return size / seconds
        grow = max(2.0, 1.2 * min_seconds / max(seconds, 1e-6))
        size = min(max_bytes, int(math.ceil(size * grow)))


def _serve(transport: Transport, dst: int, payload, token, deadline: Deadline) -> None:
    """Answer one pair's measurement on the sending side until released."""
    while True:
        transport.wait(transport.recv(token, dst, _TAG), deadline, dst, "probing: the next request")
        size = int(token.item())
        if size == 0:
            return
        transport.wait(transport.send(payload[:size], dst, _TAG), deadline, dst, f"probing: {size} bytes")
