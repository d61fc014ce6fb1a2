"""An α–β model of a GPU cluster, and the time it predicts for a switch's schedule.

The cluster is the topology YAML's ``preset: cluster`` (docs/topology.md): `hosts` hosts of
`gpus_per_host` GPUs; inside a host every GPU reaches every other through the host's switch at
`intra_bandwidth` each way (NVLink/NVSwitch class), each message paying `intra_latency`, and all of
a host's GPUs together at most `host_bandwidth` (the switch's or the memory's; by default it does
not bind: every GPU at its full rate); between
hosts a GPU uses one of the host's `nics_per_host` NICs (GPU g: NIC ``g * nics // gpus``) at
`nic_bandwidth` each way, each message paying `latency`, the fabric above the NICs being
non-blocking (a rail-optimised or full fat tree). Ranks are numbered host by host.

A round of the schedule (`reshard.schedule`) takes, on this model, the longest of every GPU's
and NIC's busy time, and of every host's switch: bytes ÷ bandwidth, in and out separately, and
the bytes moved inside the host ÷ `host_bandwidth`; plus one latency per message a GPU sends or
receives, plus its copies at `copy_bandwidth` (HBM class by default), or
`strided_copy_bandwidth` where a slice is not contiguous, plus `piece_seconds` for each piece it
cuts out or fills (the host's work of driving a copy or a message part: its views and the copy's
dispatch; 0 by default). On a host whose processors both copy and move the bytes (`host_cores`:
a CPU host, where gloo moves bytes with the cores that copy), the host's time is its bytes moved
÷ `host_bandwidth` plus, ÷ its cores, the seconds of every copy its ranks make, the processor
time of every message end (`message_host_seconds`: posting it, the transport's handling beside
its bytes), and whatever further work the caller books on each rank in each round (`predict`'s
`host_work`: on a CPU host, the kernel's work on fresh and released pages, which
`simulate.host_memory` models). That work runs in the rank's own thread, so it also adds to the
rank's busy time, as its copies do. There a rank's process also handles both ends of its
transfers with those cores, so its port passes its bytes in and out together at
`intra_bandwidth` (a rank sending to three peers takes as long as one sending and receiving the
same bytes), where a GPU's port moves them each way at that rate at once. The copies are the
executor's (`reshard.execute`): every local piece once, but none for a whole piece kept (new box
= old box: its memory is handed over); a moved piece once at the sender unless it travels alone
from a contiguous slice of the old piece, and once at the receiver unless it travels alone into
a contiguous slice of the new piece (small pieces are packed into one message per pair, copied
in and out). Rounds run one after another. What the model leaves out is said in
docs/switching.md ("Predicting a switch").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shardshift.units import parse_duration, parse_rate

_RATES = ("intra_bandwidth", "host_bandwidth", "nic_bandwidth", "copy_bandwidth", "strided_copy_bandwidth")
_TIMES = ("intra_latency", "latency", "piece_seconds", "message_host_seconds")
_TOPOLOGY_ONLY = ("hosts_per_leaf", "spines", "rails")  # shape the fabric, which the model takes as non-blocking


@dataclasses.dataclass(frozen=True)
class Cluster:
    hosts: int = 1
    gpus_per_host: int = 8
    intra_bandwidth: float = 450e9  # bytes/s each way per GPU (NVLink class); with host_cores: in and out together
    host_bandwidth: float = 0.0  # bytes/s moved inside a host by all its GPUs at once (0: gpus x intra_bandwidth)
    intra_latency: float = 2e-6
    nics_per_host: int = 8
    nic_bandwidth: float = 50e9  # bytes/s each way per NIC (400 Gbit/s)
    latency: float = 5e-6
    copy_bandwidth: float = 1e12  # bytes/s of a local copy of contiguous memory (HBM class)
    strided_copy_bandwidth: float = 0.0  # bytes/s of a copy to or from a non-contiguous slice (0: copy_bandwidth)
    host_cores: int = 0  # processors that make a host's copies and move its bytes too (a CPU host); 0: GPUs copy apart
    piece_seconds: float = 0.0  # host time each end of a piece costs (its views, the copy's dispatch), beside its bytes
    # On a CPU host (`host_cores`) only, taking turns on its cores with the copies:
    message_host_seconds: float = 0.0  # processor time each message end costs (posting it, the transport's handling)
    name: str = "cluster"

    def __post_init__(self) -> None:
        for field in ("hosts", "gpus_per_host", "nics_per_host"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cluster {field}={value!r} must be an integer >= 1")
        if not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool) or self.host_cores < 0:
            raise ValueError(f"cluster host_cores={self.host_cores!r} must be an integer >= 0 (0: GPUs copy apart)")
        if not self.strided_copy_bandwidth:
            object.__setattr__(self, "strided_copy_bandwidth", self.copy_bandwidth)
        if not self.host_bandwidth:
            object.__setattr__(self, "host_bandwidth", self.gpus_per_host * self.intra_bandwidth)
        for field in _RATES:
            if not getattr(self, field) > 0:
                raise ValueError(f"cluster {field}={getattr(self, field)!r} must be > 0 bytes/s")
        for field in _TIMES:
            if not getattr(self, field) >= 0:
                raise ValueError(f"cluster {field}={getattr(self, field)!r} must be >= 0 seconds")

    @property
    def ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    def host(self, ranks: np.ndarray) -> np.ndarray:
        return np.asarray(ranks) // self.gpus_per_host

    def nic(self, ranks: np.ndarray) -> np.ndarray:
        """The NIC (numbered over the cluster) each rank's traffic to other hosts goes through."""
        ranks = np.asarray(ranks)
        return self.host(ranks) * self.nics_per_host + (ranks % self.gpus_per_host) * self.nics_per_host // self.gpus_per_host

    def describe(self) -> str:
        return (f"{self.name}: {self.hosts} host(s) x {self.gpus_per_host} GPUs, {self.intra_bandwidth / 1e9:g} GB/s "
                f"in a host, {self.nics_per_host} x {self.nic_bandwidth * 8 / 1e9:g} Gbit/s NICs per host")


def load_cluster(path: str | Path, flag: str | None = "--cluster") -> Cluster:
    """A `Cluster` from a topology YAML file of ``preset: cluster``; ValueError in one line naming
    `flag` and the file (`shardshift.textfile`), or what in it is wrong."""
    from shardshift.textfile import naming, read_yaml

    data = read_yaml(path, flag, "a topology YAML of 'preset: cluster' (docs/topology.md)")
    try:
        return cluster_from_dict(data, Path(path).stem)
    except ValueError as err:
        raise ValueError(f"{naming(flag, path)}: {err}") from None


def cluster_from_dict(data: Mapping, name: str = "cluster") -> Cluster:
    if not isinstance(data, Mapping) or data.get("preset") != "cluster":
        raise ValueError("a cluster is a topology of 'preset: cluster' (docs/topology.md)")
    known = {f.name for f in dataclasses.fields(Cluster)} | set(_TOPOLOGY_ONLY) | {"preset"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; a cluster takes {', '.join(sorted(known - {'preset'}))}")
    values = {k: v for k, v in data.items() if k not in _TOPOLOGY_ONLY and k != "preset"}
    parsers = {**dict.fromkeys(_RATES, parse_rate), **dict.fromkeys(_TIMES, parse_duration)}
    for key, parse in parsers.items():
        if key in values:
            try:
                values[key] = parse(values[key])
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
    values.setdefault("name", name)
    return Cluster(**values)


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float  # the whole switch
    round_seconds: tuple[float, ...]
    limit_seconds: float  # the most any one GPU or NIC must move, at its bandwidth: no schedule does better
    intra_host_bytes: int
    inter_host_bytes: int
    busiest_nic_bytes: int  # in or out, the most of any NIC
    busiest_gpu_bytes: int  # received by one GPU from others
    copy_bytes: int  # local pieces copied (not handed over), the most of any GPU


def predict(schedule, cluster: Cluster, host_work: np.ndarray | None = None) -> Prediction:
    """The time `schedule` takes on `cluster` (module docstring), round by round. On a CPU host
    (`host_cores`), `host_work` (float[round, process]) is the seconds of further work each process
    does in its own thread in each round (`simulate.host_memory.page_work`)."""
    plan = schedule.plan
    n = plan.world_size
    if n > cluster.ranks:
        raise ValueError(f"the switch involves {n} processes but {cluster.name} has {cluster.ranks} GPUs; "
                         f"give a cluster of at least {n}")
    n_rounds = len(schedule.pieces)
    if host_work is not None and not cluster.host_cores:
        raise ValueError(f"host work is booked on a CPU host's cores, and {cluster.name} has host_cores=0; "
                         f"give host_cores, or no host work")
    if host_work is not None and np.shape(host_work) != (n_rounds, n):
        raise ValueError(f"host work has shape {np.shape(host_work)}; give one figure for each of the switch's "
                         f"{n_rounds} rounds and {n} processes")
    own = np.zeros((n_rounds, n)) if host_work is None else np.asarray(host_work, dtype=np.float64)
    nics = cluster.hosts * cluster.nics_per_host
    tallies, totals = [], _Tally(n, nics)
    for index, pieces in enumerate(schedule.pieces):
        tally, by_flow = _Tally(n, nics), {}
        for piece in pieces:  # a flow's pieces in one round travel between the same processes: summed first
            nbytes = piece.box.numel * plan.tensors[piece.tensor].itemsize
            entry = by_flow.setdefault(id(piece.flow), _FlowRound(piece.flow))
            entry.pieces += 1
            direct = nbytes >= schedule.direct_bytes
            entry.nbytes += nbytes
            entry.direct += direct
            entry.packed |= not direct
            old_box = plan.old_classes[piece.tensor].boxes[piece.flow.a]
            new_box = plan.new_classes[piece.tensor].boxes[piece.flow.b]
            at_source, at_target = piece.box.contiguous_in(old_box), piece.box.contiguous_in(new_box)
            seconds = [0.0 if direct and whole else nbytes / (cluster.copy_bandwidth if whole else
                                                              cluster.strided_copy_bandwidth)
                       for whole in (at_source, at_target)]
            entry.send_copy_seconds += seconds[0]
            entry.recv_copy_seconds += seconds[1]
            if piece.box == old_box == new_box:  # a whole piece kept is handed over, not copied
                entry.handed += nbytes
            else:
                slowest = cluster.copy_bandwidth if at_source and at_target else cluster.strided_copy_bandwidth
                entry.local_copy_seconds += nbytes / slowest
        for entry in by_flow.values():
            tally.add(entry, cluster)
        tallies.append(tally)
    rounds = [tally.seconds(cluster, work) for tally, work in zip(tallies, own)]
    for tally in tallies:
        totals.merge(tally)
    per_gpu_in = totals.intra_in / cluster.intra_bandwidth
    per_host = np.bincount(cluster.host(np.arange(n)), weights=totals.intra_in) / cluster.host_bandwidth
    limit = max(float(per_gpu_in.max(initial=0)), float(per_host.max(initial=0)),
                float(totals.nic_in.max(initial=0)) / cluster.nic_bandwidth,
                float(totals.nic_out.max(initial=0)) / cluster.nic_bandwidth)
    return Prediction(
        seconds=float(sum(rounds)), round_seconds=tuple(rounds), limit_seconds=limit,
        intra_host_bytes=int(totals.intra_in.sum()), inter_host_bytes=int(totals.nic_in.sum()),
        busiest_nic_bytes=int(max(totals.nic_in.max(initial=0), totals.nic_out.max(initial=0))),
        busiest_gpu_bytes=int(plan.received.max(initial=0)), copy_bytes=int(totals.copied.max(initial=0)),
    )


@dataclasses.dataclass
class _FlowRound:
    """A flow's pieces within one round, per destination: bytes, messages, time copying at each end."""

    flow: object
    nbytes: int = 0
    direct: int = 0  # pieces sent as messages of their own
    packed: bool = False  # some pieces packed in the pair's one message
    send_copy_seconds: float = 0.0
    recv_copy_seconds: float = 0.0
    local_copy_seconds: float = 0.0  # for a destination that holds the piece itself
    handed: int = 0  # bytes of it that such a destination keeps whole (handed over, not copied)
    pieces: int = 0  # each costs `Cluster.piece_seconds` at either end (once where the destination holds it)


class _Tally:
    """Bytes and messages per GPU and per NIC, in and out (one round, or the whole switch)."""

    def __init__(self, n: int, nics: int) -> None:
        self.n = n
        self.intra_in, self.intra_out = np.zeros(n), np.zeros(n)
        self.copied, self.copying = np.zeros(n), np.zeros(n)  # bytes of local pieces; seconds of every copy
        self.messages, self.remote_messages = np.zeros(n), np.zeros(n)  # ends of messages, by where the peer is
        self.nic_in, self.nic_out = np.zeros(nics), np.zeros(nics)
        self.packed: list[np.ndarray] = []  # pairs (src * n + dst) of small segments, packed one message a pair

    def add(self, entry: _FlowRound, cluster: Cluster) -> None:
        flow, nbytes, direct = entry.flow, entry.nbytes, entry.direct
        local = flow.src == flow.dst
        np.add.at(self.copied, flow.dst[local], nbytes - entry.handed)
        handling = entry.pieces * cluster.piece_seconds
        np.add.at(self.copying, flow.dst[local], entry.local_copy_seconds + handling)
        src, dst = flow.src[~local], flow.dst[~local]
        np.add.at(self.copying, src, entry.send_copy_seconds + handling)
        np.add.at(self.copying, dst, entry.recv_copy_seconds + handling)
        same = cluster.host(src) == cluster.host(dst)
        np.add.at(self.intra_in, dst[same], nbytes)
        np.add.at(self.intra_out, src[same], nbytes)
        np.add.at(self.nic_in, cluster.nic(dst[~same]), nbytes)
        np.add.at(self.nic_out, cluster.nic(src[~same]), nbytes)
        if direct:
            self._count(src, dst, same, direct)
        if entry.packed:
            self.packed.append(src * self.n + dst)

    def _count(self, src: np.ndarray, dst: np.ndarray, same: np.ndarray, times: int = 1) -> None:
        np.add.at(self.messages, np.concatenate([src[same], dst[same]]), times)
        np.add.at(self.remote_messages, np.concatenate([src[~same], dst[~same]]), times)

    def merge(self, other: "_Tally") -> None:
        for name in ("intra_in", "intra_out", "copied", "copying", "messages", "remote_messages", "nic_in", "nic_out"):
            getattr(self, name)[...] += getattr(other, name)

    def seconds(self, cluster: Cluster, host_work: np.ndarray) -> float:
        """The round's time; `host_work` (float[process]): seconds each process works in its own thread beside."""
        if self.packed:
            pairs = np.unique(np.concatenate(self.packed))
            src, dst = pairs // self.n, pairs % self.n
            self._count(src, dst, cluster.host(src) == cluster.host(dst))
            self.packed = []
        # A GPU's port moves bytes each way at once; a CPU host's rank handles both ends on its cores.
        port = self.intra_in + self.intra_out if cluster.host_cores else np.maximum(self.intra_in, self.intra_out)
        gpu = (port / cluster.intra_bandwidth
               + self.messages * cluster.intra_latency + self.remote_messages * cluster.latency
               + self.copying)
        nic = np.maximum(self.nic_in, self.nic_out) / cluster.nic_bandwidth
        hosts = cluster.host(np.arange(self.n))
        switch = np.bincount(hosts, weights=self.intra_in) / cluster.host_bandwidth
        if cluster.host_cores:  # copies, messages and host work take turns with the transfers on the host's cores
            gpu = gpu + host_work  # in the rank's own thread, as its copies are
            work = self.copying + host_work + (self.messages + self.remote_messages) * cluster.message_host_seconds
            switch = switch + np.bincount(hosts, weights=work) / cluster.host_cores
        return float(max(gpu.max(initial=0), nic.max(initial=0), switch.max(initial=0)))
