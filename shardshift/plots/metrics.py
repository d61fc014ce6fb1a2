"""A training run's history, read from the JSONL file `shardshift train --metrics` writes (pure).

Rank 0 appends one object per line (`shardshift.train.run`): a step record
``{"step", "loss", "layout", "step_time_s", "tokens_per_s", "grad_norm", "lr"}`` after every step,
and events between steps:

- ``{"event": "switch", "step": S, "from", "to", ...}``: the layout changed before step S;
- ``{"event": "membership", "step": S, "kind": join|leave|crash, "from_world", "to_world", ...}``:
  the world changed after step S;
- ``{"event": "resume", "step": S, ...}``: the run went on from a checkpoint of step S;
- ``{"event": "eval", "step": S, "held_out_loss": L, ...}``: the loss on the held-out split after
  step S (``--eval-every``).

Every event is therefore a boundary between two steps; `RunEvent.after` is the step before it.

A file is appended to, never rewritten, so it can hold steps that were later undone: a run resumed
from an earlier checkpoint, or survivors of a crash going back to one, train those steps again
and record them again. The history is what the run finally did: a step record of step S drops
every record of step S or later written before it, and every event after the boundary S - 1
(the undone future). Events of other kinds are skipped, so newer files still read; anything else
that is not a step record is an error naming the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shardshift.textfile import read_text

MEMBERSHIP_KINDS = ("join", "leave", "crash")
_FORMAT = "a --metrics file of `shardshift train` holds one JSON object per line"


@dataclass(frozen=True)
class StepPoint:
    """One optimizer step as the run recorded it."""

    step: int
    loss: float
    tokens_per_s: float
    layout: str  # e.g. "fsdp=2,tp=2"


@dataclass(frozen=True)
class RunEvent:
    """A change between two steps: a switch, a membership change or a resume."""

    kind: str  # "switch", "join", "leave", "crash" or "resume"
    step: int  # as recorded (a switch's first step under the new layout; else the step before it)
    after: int  # the last step before the change
    label: str  # e.g. "switch → fsdp=2,tp=2", "join 3→4", "resume from 40"


@dataclass(frozen=True)
class LayoutSpan:
    """Consecutive steps trained under one layout."""

    first: int
    last: int
    layout: str


@dataclass(frozen=True)
class HeldOutPoint:
    """The held-out loss after a step."""

    step: int
    loss: float


@dataclass(frozen=True)
class RunHistory:
    """What one metrics file says the run did: its steps in order, one per step, its events, and
    its held-out losses."""

    path: Path
    steps: tuple[StepPoint, ...]  # increasing step numbers
    events: tuple[RunEvent, ...]  # in the order written
    held_out: tuple[HeldOutPoint, ...] = ()  # increasing step numbers

    @property
    def spans(self) -> tuple[LayoutSpan, ...]:
        """The runs of consecutive steps under one layout, in order."""
        spans: list[LayoutSpan] = []
        for point in self.steps:
            if spans and spans[-1].layout == point.layout:
                spans[-1] = LayoutSpan(spans[-1].first, point.step, point.layout)
            else:
                spans.append(LayoutSpan(point.step, point.step, point.layout))
        return tuple(spans)


def read_history(path: Path) -> RunHistory:
    """The run `path` records; ValueError names the file (and line) that cannot be read."""
    lines = read_text(path, None, "the file `shardshift train --metrics FILE` wrote").splitlines()
    steps: dict[int, StepPoint] = {}
    events: list[RunEvent] = []
    held_out: dict[int, HeldOutPoint] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = _object(line, where)
        if record.get("event") == "eval":
            point = HeldOutPoint(_count(record, "step", where), _number(record, "held_out_loss", where))
            held_out[point.step] = point
            continue
        if "event" in record:
            event = _event(record, where)
            if event is not None:
                events.append(event)
            continue
        point = _step(record, where)
        # A step recorded again: the run went back; what it had recorded from there on is undone.
        steps = {s: p for s, p in steps.items() if s < point.step}
        events = [e for e in events if e.after < point.step]
        held_out = {s: p for s, p in held_out.items() if s < point.step}
        steps[point.step] = point
    if not steps:
        raise ValueError(f"{path}: no step records (objects with \"step\" and \"loss\"); is it the file "
                         "`shardshift train --metrics` wrote, after the run took a step?")
    return RunHistory(path, tuple(steps[s] for s in sorted(steps)), tuple(events),
                      tuple(held_out[s] for s in sorted(held_out)))


def _object(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg}, column {err.colno}); {_FORMAT}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object; {_FORMAT}")
    return record


def _step(record: dict, where: str) -> StepPoint:
    if "step" not in record or "loss" not in record:
        raise ValueError(f"{where}: neither a step record (with \"step\" and \"loss\") nor an event "
                         f"(with \"event\"); {_FORMAT}")
    return StepPoint(step=_count(record, "step", where), loss=_number(record, "loss", where),
                     tokens_per_s=_number(record, "tokens_per_s", where), layout=_text(record, "layout", where))


def _event(record: dict, where: str) -> RunEvent | None:
    """The event `record` describes; None for an event this reader does not draw."""
    name = record["event"]
    if name not in ("switch", "membership", "resume"):
        return None
    step = _count(record, "step", where)
    if name == "switch":
        return RunEvent("switch", step, step - 1, f"switch → {_text(record, 'to', where)}")
    if name == "resume":
        return RunEvent("resume", step, step, f"resume from {step}")
    kind = _text(record, "kind", where)
    if kind not in MEMBERSHIP_KINDS:
        raise ValueError(f"{where}: membership event of kind {kind!r}; expected one of {', '.join(MEMBERSHIP_KINDS)}")
    worlds = f"{_count(record, 'from_world', where)}→{_count(record, 'to_world', where)}"
    return RunEvent(kind, step, step, f"{kind} {worlds}")


def _count(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: \"{key}\" is {value!r}; expected a whole number >= 0")
    return value


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: \"{key}\" is {value!r}; expected a number")
    return float(value) if math.isfinite(value) else math.nan


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}: \"{key}\" is {value!r}; expected a string")
    return value
