"""``--tensorboard DIR``: rank 0's records of a run (`report.Metrics`, the same as ``--metrics``'
lines) as TensorBoard event files, for ``tensorboard --logdir DIR``. This module imports the
tensorboard package, an optional extra (``pip install 'shardshift[tensorboard]'``); nothing else
does, and only when the flag is given.

What a record becomes, at the step it names:

- a step record: the scalars `STEP_SCALARS` (``train/loss``, ``train/lr``, ``train/grad_norm``,
  ``train/tokens_per_s``, ...; ``train/mfu`` only where the device's peak is known, and
  ``train/compiled_graphs`` only in a step that compiled (``--compile``));
- an event: the scalars `EVENT_SCALARS` names for its kind (``eval/held_out_loss``,
  ``switch/seconds``, ``membership/world_size``, ...), and, but for ``eval``, a text at
  ``events/KIND`` (``events/switch``, ``events/membership``, ``events/resume``,
  ``events/summary``, and kinds added later): one line saying what happened (`report.event_line`),
  then the record as JSON.

Each record is flushed as it is written: a run killed at any point leaves files TensorBoard reads.

Files. TensorBoard reads the event files of a directory in the order of their names and never goes
back to an earlier one. A run's rank 0 writes one file; an elastic job's, one per world (the
process that is rank 0 changes with the world); a resumed run, a new one. So each new file is named
after every event file already in DIR (`_new_name`), and starts with a restart (``SessionLog.START``)
at the first step its records may cover, from which on TensorBoard's reader (its
``EventAccumulator``) drops what earlier files hold: the steps that a resumed run, or an elastic job
gone back to a checkpoint, trains again replace the old ones (as `shardshift.plots.metrics` reads a
``--metrics`` file).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.record_writer import RecordWriter

PREFIX = "events.out.tfevents."  # how TensorBoard knows an event file; then a 10-digit time in seconds

# A step record's keys, and their tags.
STEP_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "step_time_s": "train/step_time_s",
                "peak_memory_bytes": "train/peak_memory_bytes", "model_flops_per_s": "train/model_flops_per_s",
                "mfu": "train/mfu", "compiled_graphs": "train/compiled_graphs"}
# An event's keys, and their tags, by kind.
EVENT_SCALARS = {
    "eval": {"held_out_loss": "eval/held_out_loss"},
    "switch": {"seconds": "switch/seconds", "bytes_moved": "switch/bytes_moved",
               "peak_mem_bytes": "switch/peak_mem_bytes"},
    "membership": {"to_world": "membership/world_size", "pause_seconds": "membership/pause_seconds",
                   "bytes_moved": "membership/bytes_moved", "steps_lost": "membership/steps_lost"},
}


class EventFile:
    """A new event file in `directory` (created if missing), to which `write` adds records."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / _new_name(path)
        self.writer = RecordWriter(open(self.path, "wb"))
        self.started = False  # whether the restart that opens the file is written
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write(self, record: dict, line: str = "") -> None:
        """Add `record`; an event's text is `line`, then the record as JSON."""
        step, kind = record["step"], record.get("event")
        if not self.started:  # a step record or a switch comes before its step; the other events after
            first = step if kind in (None, "switch") else step + 1
            self._add(event_pb2.Event(wall_time=time.time(), step=first,
                                      session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
            self.started = True
        tags = STEP_SCALARS if kind is None else EVENT_SCALARS.get(kind, {})
        summary = summary_pb2.Summary()
        for key, tag in tags.items():
            if isinstance(record.get(key), int | float) and not isinstance(record[key], bool):
                summary.value.add(tag=tag, simple_value=float(record[key]))
        if kind not in (None, "eval"):
            text = f"{line}\n\n    {json.dumps(record)}" if line else json.dumps(record)
            summary.MergeFrom(text_pb(f"events/{kind}", text))
        if summary.value:
            self._add(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _add(self, event) -> None:
        self.writer.write(event.SerializeToString())
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _new_name(directory: Path) -> str:
    """A file name that sorts after every event file's in `directory`: the time in seconds, or one
    more than the newest name's when that is not later (a file a second ago, a clock set back)."""
    stamps = [int(name[len(PREFIX):].split(".")[0]) for name in os.listdir(directory)
              if name.startswith(PREFIX) and name[len(PREFIX):].split(".")[0].isdigit()]
    stamp = max([int(time.time()), *(s + 1 for s in stamps)])
    return f"{PREFIX}{stamp:010d}.{socket.gethostname()}.{os.getpid()}"
