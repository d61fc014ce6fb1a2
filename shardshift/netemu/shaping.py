"""The plan of an emulated network: names, addresses and the `ip` / `tc` commands that build it.

Pure data and string building, no processes: `network.py` runs these commands. The construction
(docs/background.md §4):

    rank namespace {name}-r{i}          bridge namespace {name}-br
    ┌─────────────────────────┐         ┌──────────────────────────┐
    │ sseth0  10.213.0.{i+1}  │─ veth ──│ p{i} ── br0 ── p{j} ...  │
    │ egress: HTB, one class  │         │ (no address; the root    │
    │ per destination rank    │         │  namespace is untouched) │
    └─────────────────────────┘         └──────────────────────────┘

Traffic from rank i to rank j is shaped once, on the egress of rank i's veth, by the HTB class of
destination j (chosen by a u32 filter on the destination address). Pure TCP ACKs skip the classes
and go out unshaped and first: without that, a fast flow whose reverse direction is slow loses
its ACK clock and falls to about 57% of its rate (docs/background.md §4).

Only per-pair links are modelled: a rank receiving from several peers at once is not limited by a
per-node (NIC) rate, and there is no latency, jitter or loss (this kernel has no netem).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from shardshift.units import format_rate

# Addresses live only inside the rank namespaces, which have no route but this subnet's: no packet
# can leave them. A /24 bounds the number of ranks.
SUBNET_PREFIX = "10.213.0."
SUBNET_BITS = 24
MAX_RANKS = 250
# The rank's interface, the same name in every rank namespace (names are per namespace): it is the
# value of GLOO_SOCKET_IFNAME for every rank.
RANK_IFNAME = "sseth0"
BRIDGE_IFNAME = "br0"

# HTB charges a class for whole Ethernet frames (1514 bytes) while TCP carries 1448 payload bytes in
# each (1500 MTU - 20 IP - 32 TCP with timestamps): a class configured at R delivers R * 1448/1514
# ≈ 0.956 R of payload (docs/background.md §4). Pair rates in this module are payload rates, so
# the configured HTB rate is raised by 1514/1448; measured payload rates then match within ~1%.
FRAME_BYTES = 1514
PAYLOAD_BYTES = 1448
FRAME_OVERHEAD = FRAME_BYTES / PAYLOAD_BYTES

# docs/background.md §4: per-link rates that a 2-core machine shapes accurately.
RELIABLE_MIN_BYTES_S = 100e6 / 8
RELIABLE_MAX_BYTES_S = 2e9 / 8

# Namespace prefixes are letters and underscores only, so that the owner pid and counter appended
# to them (see `network_name`) can be parsed back by `parse_network_name`.
_PREFIX_RE = re.compile(r"^[A-Za-z_]{1,16}$")
DEFAULT_PREFIX = "ssn"

def network_name(prefix: str, pid: int, counter: int) -> str:
    """The unique stem of one network's namespaces: prefix, owner pid, 'x', per-process counter."""
    return f"{prefix}{pid}x{counter}"


def parse_network_name(namespace: str, prefix: str) -> tuple[str, int] | None:
    """'ssn123x0-r2' → ('ssn123x0', 123) for prefix 'ssn'; None if not a namespace of prefix."""
    m = re.fullmatch(rf"({re.escape(prefix)}(\d+)x\d+)-(?:br|r\d+)", namespace)
    return (m.group(1), int(m.group(2))) if m else None


def check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"namespace prefix {prefix!r} must be 1-16 letters or underscores (the owner pid and a "
            f"counter are appended to it); e.g. prefix='ssn'")


@dataclass(frozen=True)
class EmulationPlan:
    """Everything needed to build one emulated network, validated once.

    name: stem of every namespace of this network (see `network_name`); unique per instance.
    n: number of ranks, 0..n-1.
    rates: payload rate in bytes/s of every ordered pair (src, dst), src != dst, sorted.
    """

    name: str
    n: int
    rates: tuple[tuple[tuple[int, int], float], ...]

    def __post_init__(self) -> None:
        if not 2 <= self.n <= MAX_RANKS:
            raise ValueError(f"n={self.n} ranks: need 2 <= n <= {MAX_RANKS} (one /24 subnet)")
        want = {(s, d) for s in range(self.n) for d in range(self.n) if s != d}
        have = [pair for pair, _ in self.rates]
        extra = sorted(set(have) - want)
        missing = sorted(want - set(have))
        if extra or missing or len(have) != len(set(have)):
            raise ValueError(
                f"rates must give exactly one rate for every ordered pair (src, dst) of distinct "
                f"ranks in 0..{self.n - 1}; missing {missing[:6]}"
                f"{'...' if len(missing) > 6 else ''}, "
                f"unexpected {extra[:6]}; use uniform_rates(n, rate) and override single pairs")
        for pair, rate in self.rates:
            if not rate > 0:
                raise ValueError(
                    f"rate of pair {pair} is {rate!r}; rates are bytes/s and must be > 0")

    @classmethod
    def build(cls, rates: Mapping[tuple[int, int], float], n: int, name: str) -> EmulationPlan:
        plan = cls(name=name, n=n, rates=tuple(sorted(
            ((int(s), int(d)), float(r)) for (s, d), r in rates.items())))
        outside = [(p, r) for p, r in plan.rates
                   if not RELIABLE_MIN_BYTES_S <= r <= RELIABLE_MAX_BYTES_S]
        if outside:
            warnings.warn(
                f"{len(outside)} pair rate(s), e.g. {outside[0][0]} at "
                f"{format_rate(outside[0][1])}, "
                f"lie outside 100 Mbit/s - 2 Gbit/s, the range shaped accurately on this kind of "
                f"machine (docs/background.md §4); measured rates may not follow them",
                stacklevel=3)
        return plan

    def rate(self, src: int, dst: int) -> float:
        """Configured payload rate of src → dst in bytes/s."""
        return dict(self.rates)[(src, dst)]

    @property
    def bridge_namespace(self) -> str:
        return f"{self.name}-br"

    def namespace(self, rank: int) -> str:
        self._check_rank(rank)
        return f"{self.name}-r{rank}"

    def namespaces(self) -> list[str]:
        """Every namespace of this network, bridge first (it must exist before the veths)."""
        return [self.bridge_namespace] + [self.namespace(r) for r in range(self.n)]

    def address(self, rank: int) -> str:
        self._check_rank(rank)
        return f"{SUBNET_PREFIX}{rank + 1}"

    def bridge_batch(self) -> list[str]:
        """`ip -n <bridge ns> -batch` lines: the bridge, and one veth per rank with its peer moved
        straight into the rank's namespace (it never exists in the root namespace)."""
        # addrgenmode none: no IPv6 link-local addresses, so no stray IPv6 traffic, and gloo finds
        # exactly one address (the IPv4 one, which the u32 filters match) on a rank's interface.
        lines = [f"link add {BRIDGE_IFNAME} type bridge",
                 f"link set {BRIDGE_IFNAME} addrgenmode none", f"link set {BRIDGE_IFNAME} up"]
        for r in range(self.n):
            port = f"p{r}"
            lines += [
                f"link add {port} type veth peer name {RANK_IFNAME} netns {self.namespace(r)}",
                f"link set {port} master {BRIDGE_IFNAME}",
                f"link set {port} addrgenmode none",
                f"link set {port} up",
            ]
        return lines

    def rank_batch(self, rank: int) -> list[str]:
        """`ip -n <rank ns> -batch` lines: loopback, the address, the interface up. The subnet
        route is the only route: nothing outside the network is reachable."""
        return [
            "link set lo up",
            f"addr add {self.address(rank)}/{SUBNET_BITS} dev {RANK_IFNAME}",
            f"link set {RANK_IFNAME} addrgenmode none",
            f"link set {RANK_IFNAME} up",
        ]

    def tc_batch(self, rank: int) -> list[str]:
        """`tc -n <rank ns> -batch` lines shaping rank's egress: one HTB class per destination."""
        dev = RANK_IFNAME
        # `default 0`: unclassified packets (ARP, ...) take HTB's direct queue, unshaped.
        lines = [f"qdisc add dev {dev} root handle 1: htb default 0"]
        # Pure ACKs: IPv4 with a 20-byte header (ihl=5), protocol TCP, total length < 128, and of
        # the flags FIN/SYN/RST/PSH/ACK only ACK set (byte 33 = 20 + TCP offset 13). flowid 1:0 is
        # the qdisc itself, which HTB reads as "direct": sent before any class, never shaped.
        lines.append(
            f"filter add dev {dev} parent 1: protocol ip prio 1 u32 "
            "match ip protocol 6 0xff match u8 0x05 0x0f at 0 match u16 0x0000 0xff80 at 2 "
            "match u8 0x10 0x1f at 33 flowid 1:0")
        for dst in range(self.n):
            if dst == rank:
                continue  # a rank reaches itself over loopback, not this interface
            classid = f"1:{dst + 10:x}"
            bits = round(self.rate(rank, dst) * 8 * FRAME_OVERHEAD)
            # rate = ceil: no borrowing between destinations. quantum only matters when classes
            # borrow; set it so HTB does not warn that rate/r2q is too big.
            lines.append(f"class add dev {dev} parent 1: classid {classid} htb "
                         f"rate {bits}bit ceil {bits}bit quantum 200000")
            lines.append(f"filter add dev {dev} parent 1: protocol ip prio 2 u32 "
                         f"match ip dst {self.address(dst)}/32 flowid {classid}")
        return lines

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} is outside this network's ranks 0..{self.n - 1}")


def uniform_rates(n: int, rate: float) -> dict[tuple[int, int], float]:
    """Every ordered pair of n ranks at `rate` bytes/s (a dict: override single pairs after)."""
    return {(s, d): float(rate) for s in range(n) for d in range(n) if s != d}
