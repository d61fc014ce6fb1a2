"""The coordinator of an elastic run (`shardshift train --elastic`): it serves the job's c10d store,
starts the first world's workers and the joiners of scripted joins, and watches them. They are
forks of it (`shardshift.launch.fork_rank`), made before the store's threads start.

It holds no training state and takes no part in a change of world: the workers agree on each
change among themselves, at a step boundary, through one all-reduce and the store
(`worker.py`). The coordinator's part is the store (membership epochs, the joiners' queue), the
processes it started, and how the job ends:

- every worker that exits 0 is done or left on notice;
- a worker it started whose heartbeat stops for `--heartbeat-timeout` (frozen, or cut off) is
  killed, and its death is a crash as below;
- a signal to the coordinator (SIGINT, SIGTERM, SIGHUP) is written to the store (a stop): the
  workers finish their step, save with ``--save``, and exit; what is left after the drain time is
  killed;
- a worker of the current world, or of a change of world under way (joiners admitted to it
  included), that dies otherwise (a crash) is reported to the others in the store (a
  `protocol.CrashRecord`, with every worker that died within `_Crashes.SETTLE_S`); they agree on
  the last committed step, or on going back to the world before the change, and go on without it
  (`recovery`, `moving`). A worker the job cannot go on without stops the job, naming it.

Workers started elsewhere join with ``shardshift join --coordinator HOST:PORT``. They are not the
coordinator's children: it watches their heartbeats only (by its own clock), and one silent for
`--heartbeat-timeout` is taken for crashed as above (or, not admitted yet, passed over), though
it cannot be killed from here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from shardshift.console import say
from shardshift.elastic.config import ElasticConfig, parse_address
from shardshift.elastic.membership import COORDINATOR_ENV, JOB_DIR_ENV, MEMBER_ENV
from shardshift.elastic.protocol import CrashRecord, JobStore
from shardshift.launch import DRAIN_S, GRACE_S, STOP_SIGNALS, Forked, fork_rank, import_for_forks, stop

PRELOAD = ("shardshift.elastic.worker", "shardshift.train.run")  # what the workers run, imported before forking
FINISH_GRACE_S = 2.0  # after the last step, how long the processes left have to exit by themselves

_WORKER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def listen(address: str | None) -> tuple[socket.socket, str]:
    """A socket listening for the job's store: on `address` (HOST:PORT) or on loopback and a free
    port; returns it and the address workers connect to. The store starts serving on it later
    (`serve`), once the workers are forked: a process with the store's threads must not fork."""
    host, port = parse_address(address) if address else ("127.0.0.1", 0)
    try:
        listener = socket.create_server((host, port))
    except OSError as err:
        raise ValueError(f"--coordinator {address}: cannot serve there ({err}); give an address of this "
                         "machine and a free port") from None
    return listener, f"{host}:{listener.getsockname()[1]}"


def serve(listener: socket.socket, address: str, timeout_s: float) -> dist.TCPStore:
    """The job's store, served by this process on `listener` (which it takes over)."""
    host, port = parse_address(address)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))


def launch_elastic(nproc: int, argv: Sequence[str], ecfg: ElasticConfig, *, timeout_s: float,
                   log_dir: str | None = None, drain_s: float = DRAIN_S) -> int:
    """Run the elastic job ``python -m shardshift <argv>`` from `nproc` workers; its exit status."""
    listener, address = listen(ecfg.coordinator)
    env = {k: v for k, v in os.environ.items() if k not in _WORKER_ENV}
    env[COORDINATOR_ENV] = address
    if address.startswith("127.") and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    signals: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    procs: dict[str, Forked] = {}
    try:
        # Without --log-dir the logs go to a directory of the job's, which goes with it (or, if the
        # coordinator is killed, with its workers: `worker.member_main`).
        job_dir = None if log_dir is not None else tempfile.mkdtemp(prefix="shardshift-")
        if job_dir is not None:
            env[JOB_DIR_ENV] = job_dir
        with contextlib.ExitStack() as files:
            if job_dir is not None:
                files.callback(shutil.rmtree, job_dir, ignore_errors=True)
            logs = Path(log_dir) if log_dir is not None else Path(job_dir) / "logs"
            logs.mkdir(parents=True, exist_ok=True)

            def start(name: str, command: list[str], extra: dict[str, str], passthrough: bool = False) -> None:
                out = {} if passthrough else {"stdout": files.enter_context(open(logs / f"{name}.log", "ab")),
                                              "stderr": subprocess.STDOUT}
                procs[name] = fork_rank(0, command, {**env, **extra}, stdin=subprocess.DEVNULL, handlers=previous,
                                        close_fds=(listener.fileno(),), name=name, **out)

            import_for_forks(PRELOAD)
            for rank in range(nproc):
                start(f"worker-{rank}", list(argv),
                      {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nproc), MEMBER_ENV: str(rank)}, passthrough=rank == 0)
            for k in range(ecfg.joiners_to_start):
                start(f"joiner-{k}", ["join", "--coordinator", address, "--timeout", repr(timeout_s)], {})
            store = JobStore(serve(listener, address, timeout_s))  # its threads start here, after the last fork
            store.publish_job(list(argv), nproc, ecfg.joiners_to_start)
            say(f"coordinator at {address}: add a worker with `shardshift join --coordinator {address}`")
            status, failed = _watch(procs, store, signals, drain_s, ecfg.heartbeat_s)
            succeeded = status == 0
            if not succeeded and log_dir is None:
                logs = Path(shutil.move(logs, tempfile.mkdtemp(prefix="shardshift-logs-")))
        if failed is not None:
            name, code = failed
            tail = "" if name == "worker-0" else _tail(logs / f"{name}.log")
            say(f"shardshift: {name} exited with code {code}, and the job could not go on without it; stopped the "
                f"others. Resume from the newest checkpoint (--resume).{tail}", "stderr")
        if not succeeded:
            say(f"shardshift: the workers' output is in {logs}", "stderr")
        return status
    finally:
        stop(list(procs.values()))
        listener.close()  # unless the store took it over
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(procs: dict[str, Forked], store: JobStore, signals: list[int], drain_s: float,
           heartbeat_s: float) -> tuple[int, tuple[str, int] | None]:
    """Wait for the job to end (module docstring): its status, and the worker whose crash ended it
    if one did. A crash of a worker of the current world is reported to the others (`_Crashes`),
    who go on without it if they can."""
    drained_by = finished_by = None
    crashes = _Crashes(store)
    survived: list[tuple[str, int]] = []
    while True:
        codes = {name: proc.poll() for name, proc in procs.items()}
        if finished_by is None and store.done():
            finished_by = time.monotonic() + FINISH_GRACE_S
        if finished_by is not None and time.monotonic() > finished_by:
            # The job is done; a joiner still waiting exits by itself at once, unless it is stuck
            # (frozen before it was ready): it is stopped, and its end is not the job's failure.
            left = [name for name, code in codes.items() if code is None]
            if left:
                say(f"shardshift: the job is done, but {', '.join(left)} did not exit within {FINISH_GRACE_S:g} s; "
                    "stopped", "stderr")
                stop([procs[name] for name in left], GRACE_S)
                survived += [(name, procs[name].poll()) for name in left]
                continue
        if signals and drained_by is None:
            store.request_stop(signals[0])
            drained_by = time.monotonic() + drain_s
        stopping = drained_by is not None or store.stopped()
        # A worker killed by a signal comes first: its peers fail after it (their collectives break).
        ended = sorted(((n, c) for n, c in codes.items() if c not in (None, 0) and not (stopping and c > 128)
                        and (n, c) not in survived), key=lambda item: item[1] >= 0)
        for name, code in ended:
            if not stopping and name.startswith("joiner-") and crashes.joiner_gone(procs[name].pid):
                survived.append((name, code))
                say(f"shardshift: {name} exited with code {code} before it was admitted; the job goes on", "stderr")
            elif not stopping and crashes.lost(procs[name].pid):
                survived.append((name, code))
                say(f"shardshift: {name} exited with code {code}; the others go on without it", "stderr")
            else:
                stop(list(procs.values()), GRACE_S)
                return (code if code > 0 else 128 - code), (name, code)
        crashes.publish_if_settled()
        if not stopping:
            for name in crashes.silent(procs, heartbeat_s):
                say(f"shardshift: {name} sent no heartbeat for {heartbeat_s:g} s; killed it", "stderr")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(procs[name].pid, signal.SIGKILL)  # its exit is then a crash like any other
            for member, survived_here in crashes.silent_strangers(procs, heartbeat_s) if finished_by is None else ():
                if not survived_here:
                    say(f"shardshift: worker {member} (started elsewhere) sent no heartbeat for {heartbeat_s:g} s, "
                        "and the job could not go on without it; stopped the others. Resume from the newest "
                        "checkpoint (--resume).", "stderr")
                    stop(list(procs.values()), GRACE_S)
                    return 1, None
                say(f"shardshift: worker {member} (started elsewhere) sent no heartbeat for {heartbeat_s:g} s; the "
                    "others go on without it", "stderr")
        if all(code is not None for code in codes.values()):
            if signals:
                return 128 + signals[0], None
            stopped = [c for n, c in codes.items() if c and (n, c) not in survived]
            return (stopped[0] if stopped else 0), None
        if drained_by is not None and time.monotonic() > drained_by:
            stop(list(procs.values()), GRACE_S)
            return 128 + signals[0], None
        time.sleep(0.05)


class _Crashes:
    """Crashed workers of the current world or of a change under way, reported once in a
    `CrashRecord` (the workers' only source for who is lost, so that every survivor plans from the
    same set): a short while after the first, so that workers that died together are reported
    together."""

    SETTLE_S = 0.3

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.pending: list[int] = []
        self.reported: set[int] = set()  # every worker recorded lost so far
        self.seen = 0.0  # time.time() of the first pending exit
        self.first_at = 0.0
        self.checked_at = 0.0  # the last heartbeat check (time.monotonic())
        self.stranger_checked_at = 0.0
        self.beats: dict[int, tuple[float | None, float]] = {}  # a stranger's last heartbeat, and when it changed
        self.given_up: set[int] = set()  # strangers taken for dead

    def lost(self, pid: int) -> bool:
        """Note worker process `pid` as crashed; False when it is in no world the job trains in now
        (it had left, or was never admitted): then the job cannot be sure to go on."""
        member = self.store.member_of(pid)
        if member is None or self.store.current_number() is None:
            return False
        return self._lose(member)

    def _lose(self, member: int) -> bool:
        current, newest = self.store.current_number(), self.store.newest_number()
        involved = set().union(*(self.store.epoch(n).members for n in range(current, newest + 1)))
        if member in self.reported:
            return True  # taken for lost already (its heartbeat stopped): the others went on without it
        if member not in involved:
            return False  # in no world the job trains in, nor in a change under way: not survived here
        if not self.pending:
            self.seen, self.first_at = time.time(), time.monotonic()
        self.pending.append(member)
        return True

    def joiner_gone(self, pid: int) -> bool:
        """A joiner the coordinator started exited: True, and it is passed over, if it had not been
        admitted yet (with a place in the queue, that place is marked dead)."""
        member = self.store.member_of(pid)
        if member is None:
            self.store.joiner_died_before_ready()
            return True
        index = member - self.store.first_world_size()
        if self.store.is_admitted(index):
            return False  # a member by now: a crash like any other
        self.store.mark_joiner_dead(index)
        return True

    def silent(self, procs: dict[str, Forked], heartbeat_s: float) -> list[str]:
        """Running workers of the current world whose last heartbeat is older than `heartbeat_s`
        (checked twice a second at most)."""
        now = time.monotonic()
        if now - self.checked_at < 0.5 or self.store.current_number() is None:
            return []
        self.checked_at = now
        members = set(self.store.current_epoch().members)
        out = []
        for name, proc in procs.items():
            member = self.store.member_of(proc.pid) if proc.poll() is None else None
            if member is None:
                continue
            beat = self.store.last_beat(member)
            if member in members and beat is not None and time.time() - beat > heartbeat_s:
                out.append(name)
        return out

    def silent_strangers(self, procs: dict[str, Forked], heartbeat_s: float) -> list[tuple[int, bool]]:
        """Workers this coordinator did not start (``shardshift join`` from another shell or host),
        members of the current world or ready joiners, whose heartbeat has not changed for
        `heartbeat_s` by this process's clock (theirs may be set otherwise). It cannot kill them:
        a member is taken for crashed (reported as for its own workers; the second value is
        whether that crash is survived), a joiner not admitted yet is marked dead (passed over).
        Checked at most twice a second, each worker once."""
        now = time.monotonic()
        if now - self.stranger_checked_at < 0.5 or self.store.current_number() is None:
            return []
        self.stranger_checked_at = now
        epoch = self.store.current_epoch()
        children = {self.store.member_of(p.pid) for p in procs.values()} - {None}
        waiting = {self.store.joiner_id(i): i for i in self.store.live_joiners(epoch.admitted)}
        out = []
        for member in sorted((set(epoch.members) | set(waiting)) - children - self.given_up):
            beat = self.store.last_beat(member)
            if member not in self.beats or self.beats[member][0] != beat:
                self.beats[member] = (beat, now)
            elif now - self.beats[member][1] > heartbeat_s:
                self.given_up.add(member)
                if member in waiting:
                    self.store.mark_joiner_dead(waiting[member])
                    continue
                out.append((member, self._lose(member)))
        return out

    def publish_if_settled(self) -> None:
        """Record the workers that died together, once settled, under the epoch they break: the newest
        written (the current world, or the change under way) if it has no record yet, otherwise the
        next (the change its survivors are about to make). When both have one, the record waits for
        that change to be written."""
        if not self.pending or time.monotonic() - self.first_at <= self.SETTLE_S:
            return
        newest = self.store.newest_number()
        number = next((n for n in (newest, newest + 1) if not self.store.has_crash(n)), None)
        if number is not None:
            self.store.publish_crash(number, CrashRecord(tuple(self.pending), self.seen))
            self.reported.update(self.pending)
            self.pending = []


def _tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f" Its last output ({log}):\n" + "\n".join(f"  {line}" for line in text)
