"""Which checkpoint a resume takes (`train.catalog`), on checkpoint directories made by hand: the
newest intact one of the same run; unfinished saves and damaged checkpoints passed over with the
reason; another run's refused, naming the field that differs."""

from __future__ import annotations

import dataclasses

import pytest

from shardshift.layout import Layout
from shardshift.train.catalog import FORMAT, PARTIAL_PREFIX, Manifest, RunIdentity, choose, file_table
from shardshift.train.config import TrainConfig, model_config

CFG = TrainConfig(layout=Layout(fsdp=2), model=model_config("test"), model_name="test", steps=10, global_batch=4)
RUN = RunIdentity.of(CFG, "d" * 32)


def _checkpoint(root, step: int, run: RunIdentity = RUN, payload: bytes = b"tensors") -> object:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"dcp metadata")
    (path / "__0_0.distcp").write_bytes(payload * 100)
    Manifest(FORMAT, run, "fsdp=2", step, file_table(path)).write(path)
    return path


def test_the_newest_intact_checkpoint_is_taken(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    choice = choose(str(tmp_path), RUN)
    assert choice.path == tmp_path / "step-00000006" and choice.manifest.step == 6 and choice.skipped == ()
    assert choose(str(tmp_path / "step-00000004"), RUN).manifest.step == 4  # one checkpoint, named


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "__0_0.distcp").write_bytes(b"short"), "__0_0.distcp has 5 bytes, not the 700"),
    (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"garbage" * 100), "__0_0.distcp is not what was written"),
    (lambda p: (p / "shardshift.json").unlink(), "it has no shardshift.json"),
    (lambda p: (p / "shardshift.json").write_text("{not json"), "shardshift.json cannot be read"),
    (lambda p: (p / "shardshift.json").write_text('{"format": "training-state/1"}'), "lacks or garbles"),
])
def test_a_damaged_checkpoint_is_passed_over_with_the_reason(tmp_path, damage, reason):
    _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    choice = choose(str(tmp_path), RUN)
    assert choice.path == tmp_path / "step-00000002"
    assert [(p.name, r) for p, r in choice.skipped if reason in r] == [("step-00000004", choice.skipped[0][1])]
    assert "skipped" in choice.describe() and "resuming from" in choice.describe()


def test_an_unfinished_save_is_named_and_passed_over(tmp_path):
    _checkpoint(tmp_path, 2)
    (tmp_path / (PARTIAL_PREFIX + "step-00000004")).mkdir()
    choice = choose(str(tmp_path), RUN)
    assert choice.path.name == "step-00000002" and "unfinished save" in choice.skipped[0][1]


@pytest.mark.parametrize("change, named", [
    ({"steps": 20}, "--steps: steps is 10 in the checkpoint, 20 in this run"),
    ({"seed": 1}, "--seed"),
    ({"global_batch": 8}, "--global-batch"),
    ({"dtype": "float64"}, "--dtype"),
    ({"model_name": "tiny", "model": model_config("tiny")}, "--model"),
    ({"optim": dataclasses.replace(CFG.optim, lr=0.1)}, "--lr"),
])
def test_another_runs_checkpoint_is_refused_naming_what_differs(tmp_path, change, named):
    _checkpoint(tmp_path, 4)
    mine = RunIdentity.of(dataclasses.replace(CFG, **change), RUN.data)
    with pytest.raises(ValueError, match="was saved by another run") as err:
        choose(str(tmp_path), mine)
    assert named in str(err.value) and "--save into a new directory" in str(err.value)


def test_other_data_is_another_run(tmp_path):
    _checkpoint(tmp_path, 4)
    with pytest.raises(ValueError, match="--data: the checkpoint was trained on other text"):
        choose(str(tmp_path), dataclasses.replace(RUN, data="e" * 32))


def test_nothing_to_resume_from(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        choose(str(tmp_path / "absent"), RUN)
    with pytest.raises(ValueError, match="no complete checkpoint in it"):
        choose(str(tmp_path), RUN)
    assert choose(str(tmp_path / "absent"), RUN, missing_ok=True).path is None  # --resume auto: start fresh
    (tmp_path / (PARTIAL_PREFIX + "step-00000004")).mkdir()
    auto = choose(str(tmp_path), RUN, missing_ok=True)
    assert auto.path is None and len(auto.skipped) == 1


def test_a_failed_switch_says_which_checkpoint_to_resume_from(tmp_path):
    from shardshift.comm import TransferError
    from shardshift.train.run import SwitchFailed

    lost = TransferError("rank 0: switch round 2 of 5: receiving 1.0 MiB from rank 3 (tag 1) failed: reset", peer=3)
    assert "no checkpoint was saved" in str(SwitchFailed(lost, None))
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    message = str(SwitchFailed(lost, str(tmp_path)))
    assert message.startswith("rank 0: switch round 2 of 5") and "from rank 3" in message
    assert f"resume from {tmp_path / 'step-00000004'} with --resume {tmp_path}" in message
