"""Which checkpoint a resume takes (`train.catalog`), on checkpoint directories made by hand: the
newest intact one of the same run; unfinished saves and damaged checkpoints passed over with the
reason; another run's refused, naming the field that differs."""

from __future__ import annotations

import dataclasses

import pytest

from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train.catalog import (
    FORMAT,
    PARTIAL_PREFIX,
    REPLACED_PREFIX,
    Manifest,
    RunIdentity,
    check_save_dir,
    choose,
    file_table,
    prunable,
)
from shardshift.train.config import TrainConfig

CFG = TrainConfig(layout=Layout(fsdp=2), model=model_spec("test"), steps=10, global_batch=4)
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
    (lambda p: (p / "shardshift.json").write_text('{"format": "training-state/1"}'), "lacks 'files'"),
    (lambda p: _edit_manifest(p, files={".metadata": 12}), "has 'files' = {'.metadata': 12}, not a mapping"),
    (lambda p: _edit_manifest(p, step="3"), "has 'step' = '3', not a step number"),
])
def test_a_damaged_checkpoint_is_passed_over_with_the_reason(tmp_path, damage, reason):
    _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    choice = choose(str(tmp_path), RUN)
    assert choice.path == tmp_path / "step-00000002"
    assert [(p.name, r) for p, r in choice.skipped if reason in r] == [("step-00000004", choice.skipped[0][1])]
    assert "skipped" in choice.describe() and "resuming from" in choice.describe()


def _edit_manifest(path, **fields) -> None:
    import json

    data = json.loads((path / "shardshift.json").read_text())
    (path / "shardshift.json").write_text(json.dumps({**data, **fields}))


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
    ({"model": model_spec("tiny")}, "--model"),
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
    assert f"resume with --resume {tmp_path}, which takes its newest intact checkpoint" in message
    assert "(the newest there is step-00000004)" in message


def test_resume_auto_refuses_checkpoints_none_of_which_is_intact(tmp_path):
    """Starting afresh would go on to replace them: they are named instead, with what to do."""
    (_checkpoint(tmp_path, 4) / "__0_0.distcp").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="no complete checkpoint in it") as err:
        choose(str(tmp_path), RUN, missing_ok=True)
    assert "step-00000004: its file __0_0.distcp has 9 bytes" in str(err.value)
    assert "move them away to start afresh" in str(err.value)


def test_a_checkpoint_set_aside_while_its_step_was_saved_again_is_taken(tmp_path):
    """A crash between the two renames of `checkpoint._publish`: the old checkpoint of the step is
    set aside and the new one not yet renamed in. The old one is complete and is taken."""
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4).rename(tmp_path / (REPLACED_PREFIX + "step-00000004"))
    (tmp_path / (PARTIAL_PREFIX + "step-00000004")).mkdir()
    choice = choose(str(tmp_path), RUN)
    assert choice.path == tmp_path / (REPLACED_PREFIX + "step-00000004") and choice.manifest.step == 4
    _checkpoint(tmp_path, 4)  # once the step is there again, what was set aside is not a candidate
    assert choose(str(tmp_path), RUN).path == tmp_path / "step-00000004"


def test_a_run_saves_only_into_a_directory_it_resumes_from(tmp_path):
    ckpt = tmp_path / "ckpt"
    check_save_dir(str(ckpt), None)  # absent
    ckpt.mkdir()
    (ckpt / (PARTIAL_PREFIX + "step-00000002")).mkdir()
    check_save_dir(str(ckpt), None)  # an unfinished first save holds nothing to lose
    _checkpoint(ckpt, 4)
    for resume in (None, str(tmp_path / "elsewhere")):
        with pytest.raises(ValueError, match=f"--save {ckpt} holds checkpoints already \\(newest step-00000004\\)"):
            check_save_dir(str(ckpt), resume)
    for resume in (str(ckpt), str(ckpt / "step-00000004"), str(tmp_path / "." / "ckpt" / "")):
        check_save_dir(str(ckpt), resume)


def test_pruning_removes_only_older_checkpoints_of_the_same_run(tmp_path):
    """After resuming from step 4 of a directory that also holds a damaged step 8, another run's
    step 3 and an unreadable step 1, saving step 5 with keep 2 removes step 2 only."""
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (_checkpoint(tmp_path, 8) / "__0_0.distcp").unlink()
    _checkpoint(tmp_path, 3, run=dataclasses.replace(RUN, seed=9))
    (_checkpoint(tmp_path, 1) / "shardshift.json").write_text("{")
    _checkpoint(tmp_path, 5)
    assert [p.name for p in prunable(tmp_path, RUN, 5, keep=2)] == ["step-00000002"]
    assert [p.name for p in prunable(tmp_path, RUN, 5, keep=1)] == ["step-00000004", "step-00000002"]
    assert prunable(tmp_path, RUN, 5, keep=3) == []
    assert [p.name for p in prunable(tmp_path, RUN, 9, keep=1)] == [f"step-0000000{s}" for s in (8, 6, 5, 4, 2)]


def test_the_ranks_share_out_the_checksums_of_a_checkpoint(tmp_path):
    """Each rank reads only its share of the files; the shares together are the whole table."""
    sizes = {"__0_0.distcp": 900, "__1_0.distcp": 800, "__2_0.distcp": 500, "__3_0.distcp": 400, ".metadata": 50}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    (tmp_path / "shardshift.json").write_text("{}")  # never in the table
    whole = file_table(tmp_path)
    assert sorted(whole) == sorted(sizes) and all(whole[name][0] == size for name, size in sizes.items())
    shares = [file_table(tmp_path, rank, 3) for rank in range(3)]
    assert {name: entry for share in shares for name, entry in share.items()} == whole
    assert sum(len(share) for share in shares) == len(whole)  # disjoint
    assert sorted(sum(entry[0] for entry in share.values()) for share in shares) == [850, 900, 900]
