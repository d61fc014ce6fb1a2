"""`--tensorboard DIR`: rank 0's records (`report.Metrics`) as event files that TensorBoard's own
reader (its `EventAccumulator`) reads back: the scalars of each step and event, a text for each
event, one file per world of an elastic job, and a resume's steps trained again replacing the old."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shardshift.train.report import Metrics
from shardshift.train.tensorboard import PREFIX


def _read(directory) -> EventAccumulator:
    reader = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    return reader


def _scalars(reader: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in reader.Scalars(tag)]


def _texts(reader: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in reader.Tensors(tag)]


def _step(metrics: Metrics, step: int, loss: float | None = None, mfu: float | None = None) -> None:
    """As `report.report_step` writes it."""
    metrics.write({"step": step, "loss": 5.0 - step / 4 if loss is None else loss, "layout": "dp=2",
                   "step_time_s": 0.5, "tokens_per_s": 1000.0 * step, "grad_norm": 1.5, "lr": 1e-3 * step,
                   "peak_memory_bytes": 1 << 20, "model_flops_per_s": 2e9, "mfu": mfu})


def _membership(metrics: Metrics, step: int, kind: str, worlds: tuple[int, int], steps_lost: int = 0) -> None:
    """As `elastic.member.ElasticWorker.opened` writes it."""
    metrics.write({"event": "membership", "step": step, "kind": kind, "from_world": worlds[0], "to_world": worlds[1],
                   "from": f"fsdp={worlds[0]}", "to": f"fsdp={worlds[1]}", "detect_seconds": 0.1, "pause_seconds": 0.25,
                   "bytes_moved": 4096, "steps_lost": steps_lost, "recovered_from": "replica", "planned_ahead": True,
                   "phases": {}})


def test_a_runs_steps_and_events_read_back_as_scalars_and_texts_while_it_still_runs(tmp_path):
    metrics = Metrics(None, 0, str(tmp_path / "tb"))
    for step in (1, 2, 3):
        _step(metrics, step, mfu=0.25 if step == 3 else None)
    switch = {"event": "switch", "step": 4, "from": "dp=2", "to": "fsdp=2", "seconds": 0.125, "move_seconds": 0.1,
              "bytes_moved": 8192, "peak_mem_bytes": 1 << 16, "prepared_ahead": False}
    metrics.write(switch)
    _step(metrics, 4)
    metrics.write({"event": "eval", "step": 4, "held_out_loss": 3.5, "batches": 2})
    metrics.write({"event": "summary", "step": 4, "steps": 4, "tokens": 64, "seconds": 2.0, "first_loss": 4.75,
                   "last_loss": 4.0, "held_out_loss": 3.5, "change": "switch", "changes": 1, "change_seconds": 0.125,
                   "tree_calls": {}})

    reader = _read(tmp_path / "tb")  # not closed yet: every record is flushed as it is written
    assert _scalars(reader, "train/loss") == [(1, 4.75), (2, 4.5), (3, 4.25), (4, 4.0)]
    assert _scalars(reader, "train/tokens_per_s") == [(1, 1000.0), (2, 2000.0), (3, 3000.0), (4, 4000.0)]
    assert [step for step, _ in _scalars(reader, "train/lr")] == [1, 2, 3, 4]
    for tag in ("train/grad_norm", "train/step_time_s", "train/peak_memory_bytes", "train/model_flops_per_s"):
        assert [step for step, _ in _scalars(reader, tag)] == [1, 2, 3, 4], tag
    assert _scalars(reader, "train/mfu") == [(3, 0.25)]  # only where the device's peak is known
    assert _scalars(reader, "eval/held_out_loss") == [(4, 3.5)]
    assert _scalars(reader, "switch/seconds") == [(4, 0.125)] and _scalars(reader, "switch/bytes_moved") == [(4, 8192)]
    [(step, text)] = _texts(reader, "events/switch")
    assert step == 4 and text.startswith("switched dp=2 -> fsdp=2 before step 4 in 0.12 s: moved 8.0 KiB\n")
    assert json.loads(text.split("\n\n")[1]) == switch
    [(step, text)] = _texts(reader, "events/summary")
    assert step == 4 and text.startswith("done: 4 steps, 64 tokens in 2.0 s (32 tokens/s); loss 4.7500 -> 4.0000, held-out 3.5000; 1 switch took")
    assert "events/eval" not in reader.Tags()["tensors"]  # a held-out loss is its scalar alone
    metrics.close()


def test_each_world_adds_a_file_after_the_last_and_a_resume_replaces_the_steps_trained_again(tmp_path):
    """An elastic job's rank 0 of each world writes a file of its own (within a second of the last,
    here), and a run resumed from an earlier step writes those steps again: TensorBoard reads
    the files in the order of their names, and keeps what was trained last."""
    board = str(tmp_path / "tb")
    first = Metrics(None, 0, board)
    for step in (1, 2, 3):
        _step(first, step)
    first.close()  # the world's rank 0 leaves it
    second = Metrics(None, 0, board)  # the next world's rank 0
    _membership(second, 3, "leave", (4, 3))
    for step in (4, 5, 6):
        _step(second, step)
    assert Metrics(None, 1, board).board is None  # the other ranks write nothing
    plain = Metrics(str(tmp_path / "m.jsonl"), 0)
    assert plain.board is None  # nor does a run without the flag
    plain.close()
    # A crash during step 6: the survivors go back to the checkpoint of step 4; the crashed
    # world's rank 0 never closed its file.
    third = Metrics(None, 0, board)
    _membership(third, 4, "crash", (3, 2), steps_lost=2)
    for step in (5, 6, 7):
        _step(third, step, loss=float(step))
    third.close()
    second.close()

    names = sorted(path.name for path in (tmp_path / "tb").iterdir())
    assert len(names) == 3 and all(name.startswith(PREFIX) for name in names)
    assert len({name[len(PREFIX):].split(".")[0] for name in names}) == 3  # each its own time in the name
    reader = _read(board)
    assert _scalars(reader, "train/loss") == [(1, 4.75), (2, 4.5), (3, 4.25), (4, 4.0), (5, 5.0), (6, 6.0), (7, 7.0)]
    assert _scalars(reader, "membership/world_size") == [(3, 3), (4, 2)]
    assert _scalars(reader, "membership/steps_lost") == [(3, 0), (4, 2)]
    assert [(step, text.split("\n")[0]) for step, text in _texts(reader, "events/membership")] == [
        (3, "leave: 4 -> 3 workers after step 3, fsdp=4 -> fsdp=3: paused 0.25 s, 0 step(s) lost"),
        (4, "crash: 3 -> 2 workers after step 4, fsdp=3 -> fsdp=2: paused 0.25 s, 2 step(s) lost")]

    resumed = Metrics(None, 0, board)  # a run resumed from the checkpoint of step 2
    resumed.write({"event": "resume", "step": 2, "checkpoint": "ckpt/step-00000002", "layout": "dp=2"})
    _step(resumed, 3, loss=0.5)
    resumed.close()
    reader = _read(board)
    assert _scalars(reader, "train/loss") == [(1, 4.75), (2, 4.5), (3, 0.5)]
    assert _scalars(reader, "membership/world_size") == []  # both changes came after step 2
    assert _texts(reader, "events/resume") == [
        (2, 'resumed from ckpt/step-00000002 after step 2, under dp=2\n\n    {"event": "resume", "step": 2, '
            '"checkpoint": "ckpt/step-00000002", "layout": "dp=2"}')]

