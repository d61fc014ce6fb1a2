"""Link emulation on one machine: N ranks in their own network namespaces, every ordered pair of
ranks shaped with tc to its own rate (bandwidth only: no latency or loss, this kernel has no netem).

    rates = uniform_rates(4, parse_rate("1gbit")); rates[(0, 1)] = parse_rate("200mbit")
    with EmulatedNetwork(rates, n=4) as net:
        procs = net.launch([sys.executable, "-m", "my.worker"])   # one process per rank
        supervise(procs, timeout_s=120)                            # shardshift.launch
        print(net.measure_pair(0, 1).ratio)

Each rank's processes see one interface (`RANK_IFNAME`, for GLOO_SOCKET_IFNAME) holding an address
that exists only in its namespace; workers join a process group with
`shardshift.runtime.init_distributed` (a file store in a fresh directory: no ports to pick). The
command line is in `cli.py`:
`python -m shardshift.netemu --nproc 4 --rate 1gbit -- CMD ...`.

TCP in the rank namespaces keeps its congestion window across idle periods
(`net.ipv4.tcp_slow_start_after_idle=0`, a per-namespace setting) unless `slow_start_after_idle`
is given: with the kernel's default, a connection idle for one retransmission timeout restarts
from slow start, so a collective that follows a pause (another collective on other pairs,
checking results, computing) ramps up each of its connections again. That is how clusters that
run collectives over TCP are usually tuned; docs/collectives.md has what it changes.

Everything is torn down (processes killed, namespaces deleted) on `with` exit, `close()`, at
interpreter exit, and on SIGTERM / SIGINT; `cleanup_stale()` removes what a killed process left.
Needs root and iproute2; `netns_unavailable_reason()` says why it cannot run here.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardshift.launch import dies_with_this_process, start_ranks, stop
from shardshift.netemu.processes import (
    COMMAND_TIMEOUT_S,
    KILL_GRACE_S,
    list_namespaces,
    register,
    run_command,
    unregister,
)
from shardshift.netemu.shaping import DEFAULT_PREFIX, RANK_IFNAME, EmulationPlan, check_prefix, network_name
from shardshift.units import format_rate

_PROBE = Path(__file__).with_name("pair_probe.py")
_COUNTER = itertools.count()  # with the pid, makes namespace names unique per instance


@dataclass(frozen=True)
class PairMeasurement:
    """One measured transfer src → dst: configured and measured payload rates in bytes/s."""

    src: int
    dst: int
    configured: float
    measured: float
    nbytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.measured / self.configured


def netns_unavailable_reason() -> str | None:
    """None if this process can build emulated networks; otherwise why not, and what to do."""
    if os.geteuid() != 0:
        return "link emulation needs root (network namespaces and tc); run as root, e.g. in CI"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "link emulation needs iproute2's `ip` and `tc`; install iproute2"
    if shutil.which("sysctl") is None:
        return "link emulation needs `sysctl` (to tune TCP in the namespaces); install procps"
    probe = f"{network_name(DEFAULT_PREFIX, os.getpid(), next(_COUNTER))}-br"
    try:
        run_command(["ip", "netns", "add", probe], what="create a test namespace")
    except RuntimeError as err:
        return str(err)
    run_command(["ip", "netns", "del", probe], what="delete the test namespace")
    return None


class EmulatedNetwork:
    """n ranks, each in its own network namespace, joined by a bridge in a namespace of its own;
    the payload rate of every ordered pair (src, dst) is `rates[(src, dst)]` bytes/s.

    Use as a context manager (or call `start()` / `close()`). Namespace names are
    `{prefix}{pid}x{counter}-r{rank}` and `...-br`: unique per instance, never shared.
    """

    def __init__(self, rates: Mapping[tuple[int, int], float], n: int,
                 prefix: str = DEFAULT_PREFIX, slow_start_after_idle: bool = False) -> None:
        check_prefix(prefix)
        self.slow_start_after_idle = slow_start_after_idle  # the kernel's default: see module doc
        self.plan = EmulationPlan.build(
            rates, n, network_name(prefix, os.getpid(), next(_COUNTER)))
        self._owner_pid = os.getpid()
        self._procs: list[subprocess.Popen] = []
        self._tmpdir: Path | None = None
        self._launches = itertools.count()
        self._state = "new"  # new → started → closed

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNetwork:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_on_leftovers=exc_type is None)

    def start(self) -> None:
        """Build the namespaces, links and shaping (about 0.1 s for 4 ranks, more as n² grows)."""
        if self._state != "new":
            raise RuntimeError(f"network {self.name} was already started; build a new one")
        register(self)  # first: a signal during the build must tear down what exists
        self._state = "started"
        plan = self.plan
        try:
            self._tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
            run_command(["ip", "-batch", "-"], what="create the namespaces",
                        input="".join(f"netns add {ns}\n" for ns in plan.namespaces()))
            run_command(["ip", "-n", plan.bridge_namespace, "-batch", "-"],
                        what="build the bridge", input=_lines(plan.bridge_batch()))
            for rank in range(plan.n):
                self._check_open()
                ns = plan.namespace(rank)
                run_command(["ip", "-n", ns, "-batch", "-"], what=f"configure rank {rank}",
                            input=_lines(plan.rank_batch(rank)))
                run_command(["tc", "-n", ns, "-batch", "-"], what=f"shape rank {rank}'s links",
                            input=_lines(plan.tc_batch(rank)))
                if not self.slow_start_after_idle:
                    run_command(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                                 "net.ipv4.tcp_slow_start_after_idle=0"],
                                what=f"keep TCP windows across idle periods in rank {rank}")  # fmt: skip
        except BaseException:
            self.close(raise_on_leftovers=False)
            raise

    def close(self, raise_on_leftovers: bool = True) -> None:
        """Kill this network's processes, delete its namespaces and files. Idempotent."""
        if self._state == "closed" or os.getpid() != self._owner_pid:
            return  # a forked child must not tear down its parent's network
        self._state = "closed"
        try:
            stop(self._procs, KILL_GRACE_S)
            for proc in self._procs:
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            self._procs.clear()
            names = self.plan.namespaces()
            # -force: go on past namespaces that were never created (failed start).
            run_command(["ip", "-force", "-batch", "-"], what="delete the namespaces",
                        check=False, input="".join(f"netns del {ns}\n" for ns in names))
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            left = sorted(set(names) & set(list_namespaces()))
        finally:
            unregister(self)
        if left:
            msg = (f"could not delete namespaces {left}; delete them with "
                   f"`ip netns del NAME` or `python -m shardshift.netemu cleanup`")
            if raise_on_leftovers:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)

    # ---- where the ranks are ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def n(self) -> int:
        return self.plan.n

    @property
    def ifname(self) -> str:
        """The rank's interface inside its namespace (same name in each): GLOO_SOCKET_IFNAME."""
        return RANK_IFNAME

    def namespace(self, rank: int) -> str:
        return self.plan.namespace(rank)

    def address(self, rank: int) -> str:
        """Rank's IPv4 address; it exists only inside rank's namespace."""
        return self.plan.address(rank)

    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment that binds a rank's communication to its emulated interface."""
        return {
            "GLOO_SOCKET_IFNAME": RANK_IFNAME,
            "TP_SOCKET_IFNAME": RANK_IFNAME,
            "SHARDSHIFT_ADDR": self.address(rank),
            "MASTER_ADDR": self.address(0),
        }

    # ---- running processes in a rank's namespace -------------------------------------------

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run inside rank's namespace."""
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def spawn(self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start argv in rank's namespace with `rank_env(rank)` (then `env`) over os.environ.
        The process leads a new session, so teardown kills it with its children, and it gets
        SIGTERM if this process dies (`shardshift.launch.dies_with_this_process`)."""
        if self._state != "started":
            raise RuntimeError(f"network {self.name} is {self._state}; spawn inside `with`")
        full_env = {**os.environ, **self.rank_env(rank), **(env or {})}
        proc = subprocess.Popen(self.command(rank, argv), env=full_env, start_new_session=True,
                                preexec_fn=dies_with_this_process(), **popen_kwargs)
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def run(self, rank: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Run argv in rank's namespace to completion; stdout and stderr captured as text."""
        proc = self.spawn(rank, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop([proc], KILL_GRACE_S)
            raise TimeoutError(
                f"{list(argv)} on rank {rank} ran past {timeout_s} s; killed") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def launch(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
               **popen_kwargs) -> list[subprocess.Popen]:
        """Start argv once per rank, each in its namespace, through `shardshift.launch.start_ranks`:
        RANK, WORLD_SIZE, LOCAL_RANK and SHARDSHIFT_STORE (a fresh file-store path) are set, and a
        rank joins its group with `shardshift.runtime.init_distributed`."""
        if self._tmpdir is None:
            raise RuntimeError(f"network {self.name} is not started; launch inside `with`")
        store = self._tmpdir / f"store{next(self._launches)}"  # must not exist yet
        return start_ranks(self.n, argv, str(store), env=env, spawn=self.spawn, **popen_kwargs)

    # ---- measuring -------------------------------------------------------------------------

    def measure_pair(self, src: int, dst: int, seconds: float = 0.25) -> PairMeasurement:
        """Send about `seconds` worth of data (at the configured rate) from src to dst over one
        TCP connection and time it at the receiver."""
        configured = self.plan.rate(src, dst)
        nbytes = max(int(configured * seconds), 1 << 20)
        probe = [sys.executable, str(_PROBE)]
        recv = self.spawn(dst, [*probe, "recv", self.address(dst), str(nbytes)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        send = None
        try:
            port = recv.stdout.readline().strip()  # printed once the port is bound
            if not port.isdigit():
                raise RuntimeError(f"probe receiver on rank {dst} failed: "
                                   f"{port}{recv.communicate(timeout=5)[1]}")
            send = self.spawn(src, [*probe, "send", self.address(dst), port, str(nbytes)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _, send_err = send.communicate(timeout=COMMAND_TIMEOUT_S)
            out, recv_err = recv.communicate(timeout=COMMAND_TIMEOUT_S)
        finally:
            stop([recv, *([send] if send is not None else [])], KILL_GRACE_S)
        if send.returncode or recv.returncode:
            raise RuntimeError(f"measuring {src} → {dst} failed: {send_err}{recv_err}")
        result = json.loads(out)
        counted = result["bytes"] - result["first"]
        return PairMeasurement(src, dst, configured, counted / result["seconds"],
                               result["bytes"], result["seconds"])

    def measure(self, pairs: Iterable[tuple[int, int]] | None = None,
                seconds: float = 0.25) -> list[PairMeasurement]:
        """Measure pairs one at a time (all ordered pairs by default)."""
        if pairs is None:
            pairs = [pair for pair, _ in self.plan.rates]
        return [self.measure_pair(s, d, seconds) for s, d in pairs]

    def _check_open(self) -> None:
        if self._state != "started":
            raise RuntimeError(f"network {self.name} was closed while being built")

    def __repr__(self) -> str:
        rates = sorted({r for _, r in self.plan.rates})
        return (f"EmulatedNetwork({self.name!r}, n={self.n}, {self._state}, "
                f"rates {format_rate(rates[0])} .. {format_rate(rates[-1])})")


def _lines(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)
