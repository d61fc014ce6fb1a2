"""What a run says and records: the progress line and the ``--metrics`` and ``--tensorboard``
records of its steps and switches (`report_step`, `report_switch`; rank 0's `Metrics`), its
`Summary` at the end, and the stop signals it records (`Signals`, `Stopped`)."""

from __future__ import annotations

import json
import signal
import time

import torch
import torch.distributed as dist

from shardshift.console import say
from shardshift.train.config import TrainConfig
from shardshift.train.parallelize import TREE_AXES
from shardshift.train.trainer import StepResult, Trainer
from shardshift.units import format_size


class Stopped(Exception):
    """The ranks agreed to stop for a signal; `signum` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Signals:
    """`STOP_SIGNALS`, recorded while a run trains (the handler does nothing else)."""

    def __init__(self) -> None:
        self.received = 0
        self.received_at = 0.0  # time.monotonic() when the first arrived
        self.previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in self.previous:
            signal.signal(sig, self._record)

    def _record(self, signum: int, _frame) -> None:
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (0: none): a collective, so that all stop at one step."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Metrics:
    """Rank 0's records of steps and events: lines of a JSONL file (`path`, ``--metrics``) and a
    TensorBoard event file in `tensorboard` (``--tensorboard``, `train.tensorboard`); a no-op
    elsewhere or without either."""

    def __init__(self, path: str | None, rank: int, tensorboard: str | None = None) -> None:
        self.file = open(path, "a") if (path and rank == 0) else None
        self.board = None
        if tensorboard and rank == 0:
            from shardshift.train.tensorboard import EventFile

            self.board = EventFile(tensorboard)

    @classmethod
    def of(cls, cfg: TrainConfig, rank: int) -> Metrics:
        """The records `cfg` asks for (``--metrics``, ``--tensorboard``), as `rank` writes them."""
        return cls(cfg.metrics, rank, cfg.tensorboard)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is not None:
            self.board.write(record, event_line(record) if "event" in record else "")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def event_line(event: dict) -> str:
    """What `event` (a record of `Metrics`) says, in one line."""
    kind, step = event["event"], event["step"]
    if kind == "switch":
        return (f"switched {event['from']} -> {event['to']} before step {step} in {event['seconds']:.2f} s: moved "
                f"{format_size(event['bytes_moved'])}")
    if kind == "membership":
        return (f"{event['kind']}: {event['from_world']} -> {event['to_world']} workers after step {step}, "
                f"{event['from']} -> {event['to']}: paused {event['pause_seconds']:.2f} s, "
                f"{event['steps_lost']} step(s) lost")
    if kind == "resume":
        return f"resumed from {event['checkpoint']} after step {step}, under {event['layout']}"
    if kind == "summary":
        return Summary.line(event)
    return f"{kind} after step {step}"


def report_step(cfg: TrainConfig, result: StepResult, metrics: Metrics) -> None:
    if cfg.log_every and (result.step % cfg.log_every == 0 or result.step == cfg.stop_at):
        mfu = "" if result.mfu is None else f" | MFU {result.mfu:.1%}"
        compiled = f" | compiled {result.compiled} graph(s) in {result.step_time_s:.1f} s" if result.compiled else ""
        say(f"step {result.step:5d} | loss {result.loss:.6f} | lr {result.lr:.2e} | "
            f"grad norm {result.grad_norm:.3f} | {result.tokens_per_s:,.0f} tokens/s | "
            f"{format_size(result.peak_memory)} peak | {result.flops_per_s / 1e9:,.2f} GFLOP/s{mfu}{compiled}")
    metrics.write({
        "step": result.step,
        "loss": result.loss,
        "layout": str(cfg.layout),
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "peak_memory_bytes": result.peak_memory,
        "model_flops_per_s": result.flops_per_s,
        "mfu": result.mfu,
        **({"compiled_graphs": result.compiled} if result.compiled else {}),
    })


def report_eval(cfg: TrainConfig, step: int, loss: float, metrics: Metrics) -> None:
    """The held-out loss after `step` (`Trainer.evaluate`), said and recorded."""
    say(f"step {step:5d} | held-out loss {loss:.6f} ({cfg.eval_batches} batches of {cfg.global_batch})")
    metrics.write({"event": "eval", "step": step, "held_out_loss": loss, "batches": cfg.eval_batches})


def report_switch(report, metrics: Metrics) -> None:
    say(
        f"switched {report.old} -> {report.new} before step {report.step} in {report.seconds:.2f} s "
        f"(prepared in {report.prepare_seconds:.2f} s{' ahead' if report.prepared_ahead else ''}): "
        f"moved {format_size(report.bytes_moved)} (lower bound {format_size(report.bytes_lower_bound)}), kept "
        f"{format_size(report.bytes_kept)} in place, {report.rounds} round(s), peak {format_size(report.peak_mem_bytes)} "
        f"per rank, {format_size(report.extra_mem_bytes)} over max(old, new) (budget {format_size(report.budget)})"
    )
    metrics.write(report.event())


class Summary:
    """What a run did, said at its end (rank 0): steps, tokens, wall time, the loss from its first
    to its last step, the changes it made (`change`: online switches, or an elastic job's changes
    of world) and the time they took, and the calls its data groups ran on trees."""

    def __init__(self, cfg: TrainConfig, change: str = "switch") -> None:
        self.cfg, self.change, self.start = cfg, change, time.monotonic()
        self.steps = self.changes = 0
        self.first_loss = self.last_loss = self.held_out_loss = None
        self.change_seconds = 0.0
        self.tree_calls: dict[str, int] = {}  # of the layouts switched from

    def stepped(self, result: StepResult) -> None:
        self.steps += 1
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss

    def evaluated(self, loss: float) -> None:
        self.held_out_loss = loss

    def switching(self, trainer: Trainer) -> None:
        """Before a switch: the calls of the groups it leaves behind."""
        self.tree_calls = _added(self.tree_calls, tree_calls(trainer))

    def changed(self, seconds: float) -> None:
        self.changes += 1
        self.change_seconds += seconds

    def report(self, trainer: Trainer, metrics: Metrics) -> None:
        """Say the run's end in one line, and record it in the metrics (rank 0)."""
        event = self.event(trainer)
        say(Summary.line(event))
        metrics.write(event)

    def event(self, trainer: Trainer) -> dict:
        return {"event": "summary", "step": trainer.progress.step, "steps": self.steps,
                "tokens": self.steps * self.cfg.tokens_per_step, "seconds": time.monotonic() - self.start,
                "first_loss": self.first_loss, "last_loss": self.last_loss, "held_out_loss": self.held_out_loss,
                "change": self.change,
                "changes": self.changes, "change_seconds": self.change_seconds,
                "tree_calls": _added(self.tree_calls, tree_calls(trainer))}

    @staticmethod
    def line(event: dict) -> str:
        seconds = event["seconds"]
        text = (f"done: {event['steps']} steps, {event['tokens']:,} tokens in {seconds:.1f} s "
                f"({event['tokens'] / seconds:,.0f} tokens/s)")
        if event["first_loss"] is not None:
            text += f"; loss {event['first_loss']:.4f} -> {event['last_loss']:.4f}"
        if event.get("held_out_loss") is not None:
            text += f", held-out {event['held_out_loss']:.4f}"
        if event["changes"]:
            name = event["change"]
            if event["changes"] > 1:  # "switch" -> "switches", "change of world" -> "changes of world"
                head, space, tail = name.partition(" ")
                name = head + ("es" if head.endswith(("s", "sh", "ch")) else "s") + space + tail
            text += (f"; {event['changes']} {name} took {event['change_seconds']:.2f} s "
                     f"({event['change_seconds'] / seconds:.1%} of the run)")
        if event["tree_calls"]:
            calls = ", ".join(f"{op} {count}" for op, count in sorted(event["tree_calls"].items()))
            text += f"; on trees: {calls}"
        return text


def tree_calls(trainer: Trainer) -> dict[str, int]:
    """The calls this rank's data-axis groups ran on trees, by op (none unless --collectives trees)."""
    calls: dict[str, int] = {}
    for axis in TREE_AXES:
        calls = _added(calls, getattr(trainer.par.mesh[axis].get_group(), "tree_calls", {}))
    return calls


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {op: a.get(op, 0) + b.get(op, 0) for op in sorted({*a, *b})}
