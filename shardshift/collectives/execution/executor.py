"""Run a compiled plan (program.py) over point-to-point transfers (`shardshift.comm`).

`run_plan(plan, buffer, transport, ...)` moves and combines the chunks of `buffer` (a flat,
contiguous tensor of `plan.count` elements, the schedule's buffer) for the calling rank, over the
`Transport` of a group (any group: the job's world, a backend's private gloo group, the tests'
in-process group). Every rank of the group must call it with the same plan (the caller checks
that, see runner.py).

Messages travel in queues, one per (peer, lane, direction); the lane is the transfer's tree and is
the message tag, so each queue is its own first-in first-out stream (program.py). Two modes,
both deadlock-free by the schedule's ordering rule (planning/schedule.py):

  DATAFLOW (default)  every op is posted as soon as it is ready (its chunk final on this rank for
      a send; for a receive, a free scratch slot or, for a COPY, the chunk's earlier writes applied
      and earlier sends done), in queue order, at most `window` ahead per queue, by whichever
      thread made it ready: a relay forwards chunk k from the thread that received it while chunk
      k+1 is still arriving, and a fast link never waits for a slow one. One thread per queue waits
      for the queue's posted ops in order and accounts for them (combining REDUCE receives in
      global order). Threads are needed because gloo's `is_completed()` on point-to-point work
      stays false until `wait()` is called (docs/background.md); `wait()` releases the GIL.
  STEPPED  for every schedule step: post all of this rank's sends and receives of the step as one
      round (`Transport.post_round`: a batch on CUDA), wait for them, combine the REDUCE receives
      in global order. One thread, but each step waits for its slowest transfer. On an emulated
      4-rank network it reached under half the rate of DATAFLOW; it is the fallback for devices
      where threads posting point-to-point work concurrently is not known to be safe (NCCL).

Why DATAFLOW cannot deadlock: every op depends only on ops earlier in the global order (its
dependencies, program.py) and on the earlier ops of its own queue. Take the first unfinished
transfer X (a → b) in the global order. On a, every earlier op of X's send queue has finished and
X's dependencies are done; the last of them to finish ran `pump`, which posted X (the window
holds only ops from X on). On b the same holds for X's receive queue. Both queues are X's tag
between a and b, whose messages match first-in first-out, so X completes, and the queue's thread,
waiting for its oldest op, accounts for it; by induction every transfer completes.

Every wait is bounded: point-to-point waits get the time left until the collective's deadline,
and so do waits for dependencies. A failure or timeout raises `TransferError` naming the rank,
transfer, peer and step; after one the group's message streams are out of step, so the caller
must not run further collectives on it (runner.py refuses to).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from enum import Enum
from operator import itemgetter

import torch

from shardshift.collectives.execution.program import ExecutionPlan, RecvOp, SendOp
from shardshift.comm.p2p import Deadline, PeerOp, TransferError, Transport

Combine = Callable[[torch.Tensor, torch.Tensor], None]


class ExecMode(Enum):
    DATAFLOW = "dataflow"
    STEPPED = "stepped"


class _Aborted(Exception):
    """Another thread of the same collective failed first."""


def run_plan(plan: ExecutionPlan, buffer: torch.Tensor, transport: Transport, *, combine: Combine | None,
             deadline: Deadline, mode: ExecMode = ExecMode.DATAFLOW, window: int = 4,
             pool: ThreadPoolExecutor | None = None) -> None:
    """Run `plan` on `buffer` for this rank (see module docstring). `combine(into, other)` applies
    REDUCE receives; `pool` needs at least one free worker per queue (peer, lane, direction)."""
    if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != plan.count:
        raise ValueError(f"buffer must be flat and contiguous with {plan.count} elements, got "
                         f"shape {tuple(buffer.shape)} (contiguous={buffer.is_contiguous()})")  # fmt: skip
    if combine is None and any(isinstance(op, RecvOp) and op.reduce for op in plan.program.ops):
        raise ValueError(f"{plan.op.value} reduces: give `combine`")
    if mode is ExecMode.STEPPED:
        _run_stepped(plan, buffer, transport, combine, deadline)
    else:
        _run_dataflow(plan, buffer, transport, combine, deadline, max(1, window), pool)


# ------------------------------------------------------------------------------------------
# Shared bookkeeping

class _Clock:
    """The collective's deadline, its transport, and the error that stops all of its threads."""

    def __init__(self, plan: ExecutionPlan, transport: Transport, deadline: Deadline) -> None:
        self.plan = plan
        self.transport = transport
        self.deadline = deadline
        self.error: BaseException | None = None

    def left(self, op: SendOp | RecvOp) -> float:
        """Seconds left to wait for something `op` needs; TransferError once there are none."""
        seconds = self.deadline.left()
        if seconds <= 0:
            raise self.transport.error(op.peer, _where(self.plan, op), "timed out")
        return seconds

    def wait_work(self, work, op: SendOp | RecvOp) -> None:
        self.transport.wait(work, self.deadline, op.peer, lambda: _where(self.plan, op))


def _where(plan: ExecutionPlan, op: SendOp | RecvOp) -> str:
    verb = f"sending chunk {op.chunk} to" if isinstance(op, SendOp) else f"receiving chunk {op.chunk} from"
    return f"{plan.op.value}: {verb} rank {op.peer} (transfer {op.index}, step {op.step})"


# ------------------------------------------------------------------------------------------
# DATAFLOW

class _Queue:
    """One peer and direction: ops in global order, the next one to post, the posted ones."""

    def __init__(self, peer: int, lane: int, ops: tuple, is_send: bool, lock: threading.Lock,
                 scratch: list[torch.Tensor]) -> None:
        self.peer, self.lane, self.ops, self.is_send = peer, lane, ops, is_send
        self.next = 0  # ops[:next] are posted
        self.done = 0  # ops[:done] are finished
        self.posted: deque = deque()  # (op, work, landing) for ops[done:next]
        self.cond = threading.Condition(lock)  # wakes this queue's thread only
        self.scratch = scratch  # REDUCE receives land in scratch[i % window]


class _Dataflow(_Clock):
    """Posting is eager and done by whichever thread makes an op ready (`pump`, under the lock):
    a relay forwards a chunk from the thread that received it, without a hand-off. One thread per
    queue waits for its posted ops in order (gloo work completes only through `wait()`), and is
    woken only when its own queue changes: on 2 cores, waking every thread per message cost more
    than the messages."""

    def __init__(self, plan, buffer, transport, combine, deadline, window) -> None:
        super().__init__(plan, transport, deadline)
        self.buffer, self.combine, self.window = buffer, combine, window
        program = plan.program
        self.lock = threading.Lock()
        self.applied = [0] * program.num_chunks  # writes applied, per chunk
        self.sent = [0] * program.num_chunks  # sends completed, per chunk
        self.blocked: dict[int, list[threading.Condition]] = {}  # chunk → threads waiting on it
        self.sends = [_Queue(peer, lane, ops, True, self.lock, []) for peer, lane, ops in program.sends]
        self.recvs = []
        for peer, lane, ops in program.recvs:
            numel = max((op.numel for op in ops if op.reduce), default=0)
            scratch = [buffer.new_empty(numel) for _ in range(window)] if numel else []
            self.recvs.append(_Queue(peer, lane, ops, False, self.lock, scratch))
        # The queues holding an op on each chunk: only they can become ready when its counters move.
        queues = self.sends + self.recvs
        self.touching = [[queues[i] for i in found] for found in program.touching]

    def pump(self, queues: list[_Queue] | None = None) -> None:
        """Post every op of `queues` (default all) that is next in its queue, ready, and within
        the window (lock held). Posting in queue order keeps each lane's FIFO; the sends found are
        posted in the global order, earliest first, whatever their queue: gloo writes them to the
        peer's connection in the order posted, so a lane's early chunk is not queued behind
        another lane's whole window (at the start every lane has a window ready at once). gloo's
        send/recv only enqueue, so this is short."""
        if self.error is not None:
            return
        applied, sent, buffer, window = self.applied, self.sent, self.buffer, self.window
        ready = []
        for q in self.sends + self.recvs if queues is None else queues:
            if q.is_send:  # ready: final on this rank (its earlier writes applied)
                for op in q.ops[q.next:q.done + window]:
                    if applied[op.chunk] < op.after_writes:
                        break
                    ready.append((op.index, q))
                continue
            first = q.next
            while q.next < len(q.ops) and q.next - q.done < window:
                op = q.ops[q.next]
                if op.reduce:  # lands in scratch: at most `window` posted, so this slot is free
                    landing = q.scratch[q.next % window][: op.numel]
                elif applied[op.chunk] >= op.ordinal and sent[op.chunk] >= op.after_sends:
                    landing = buffer[op.begin:op.end]  # earlier writes applied, earlier reads done
                else:
                    break
                q.posted.append((op, self.transport.recv(landing, q.peer, q.lane), landing))
                q.next += 1
            if q.next != first:
                q.cond.notify()
        ready.sort(key=itemgetter(0))
        for _, q in ready:  # a queue's ops keep their order: the global order is the queue order
            op = q.ops[q.next]
            q.posted.append((op, self.transport.send(buffer[op.begin:op.end], q.peer, q.lane), None))
            q.next += 1
            q.cond.notify()

    def count(self, counters: list[int], chunk: int) -> None:
        """One more write applied to / send completed of `chunk` by an op that just left its
        queue's window (lock held): wake the chunk's waiters and post what became ready. An op
        waits only on its chunk's counters and its own queue's window, and the finished op's
        queue holds an op on `chunk`, so pumping the queues touching `chunk` is enough."""
        counters[chunk] += 1
        for cond in self.blocked.pop(chunk, ()):
            cond.notify()
        self.pump(self.touching[chunk])

    def wait(self, q: _Queue, ready: Callable[[], bool], op, chunk: int | None = None) -> None:
        """Block q's thread until `ready()` (lock held); `chunk`: it depends on that chunk's counters."""
        while not ready():
            if self.error is not None:
                raise _Aborted
            if chunk is not None:
                self.blocked.setdefault(chunk, []).append(q.cond)
            q.cond.wait(self.left(op))

    def finish(self, q: _Queue) -> None:
        """Thread body: wait for the queue's posted ops in order and account for them."""
        applied, sent = self.applied, self.sent
        while q.done < len(q.ops):
            with self.lock:
                self.wait(q, lambda: bool(q.posted), q.ops[q.done])
                op, work, landing = q.posted[0]
            self.wait_work(work, op)
            if not q.is_send and op.reduce:
                # Combine in global order (deterministic sums), once earlier reads of it are done.
                with self.lock:
                    self.wait(q, lambda: applied[op.chunk] >= op.ordinal and sent[op.chunk] >= op.after_sends,
                              op, op.chunk)
                self.combine(self.buffer[op.begin:op.end], landing)
            with self.lock:
                q.posted.popleft()
                q.done += 1
                self.count(sent if q.is_send else applied, op.chunk)

    def fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error
            for q in self.sends + self.recvs:
                q.cond.notify_all()


def _run_dataflow(plan, buffer, transport, combine, deadline, window, pool) -> None:
    flow = _Dataflow(plan, buffer, transport, combine, deadline, window)
    queues = flow.sends + flow.recvs
    if not queues:
        return
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=len(queues), thread_name_prefix="shardshift-p2p")
    try:
        with flow.lock:
            flow.pump()
        futures = [pool.submit(_guarded, flow, q) for q in queues]
        left = deadline.left() + 5.0  # the threads time out by themselves first
        done, pending = wait_futures(futures, timeout=max(left, 0.1), return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors or pending:
            flow.fail(errors[0] if errors else RuntimeError("threads did not finish"))
            # Threads blocked in a point-to-point wait leave when it times out; don't wait for them.
            done, _ = wait_futures(pending, timeout=1.0)
            errors += [f.exception() for f in done if f.exception() is not None]
            real = [e for e in errors if not isinstance(e, _Aborted)]
            raise real[0] if real else TransferError(
                f"rank {plan.program.rank}: {plan.op.value} did not finish in time")
    except BaseException as err:
        flow.fail(err)
        raise
    finally:
        if own_pool:
            pool.shutdown(wait=False)


def _guarded(flow: _Dataflow, q: _Queue) -> None:
    try:
        flow.finish(q)
    except BaseException as err:
        flow.fail(err)
        raise


# ------------------------------------------------------------------------------------------
# STEPPED

def _run_stepped(plan: ExecutionPlan, buffer, transport: Transport, combine, deadline: Deadline) -> None:
    scratch = buffer.new_empty(plan.program.step_reduce_numel)
    for step_ops in plan.program.steps:
        sends, recvs, reduces, offset = [], [], [], 0
        for op in step_ops:  # global order: both ends of every (pair, lane) keep it
            if isinstance(op, SendOp):
                sends.append(PeerOp(op.peer, buffer[op.begin:op.end], op.lane))
            elif op.reduce:
                landing = scratch[offset:offset + op.numel]
                offset += op.numel
                reduces.append((op, landing))
                recvs.append(PeerOp(op.peer, landing, op.lane))
            else:
                recvs.append(PeerOp(op.peer, buffer[op.begin:op.end], op.lane))
        what = f"{plan.op.value}: step {step_ops[0].step}"
        transport.post_round(sends, recvs, what).wait(deadline)
        for op, landing in reduces:  # global order: deterministic sums
            combine(buffer[op.begin:op.end], landing)
