"""The checkpoints of a ``--save`` directory: which are complete, which run wrote each, which one a
resume takes. Pure file reading: no process group, so the launcher runs it before any process
starts, and every rank runs it again under torchrun.

A save (`checkpoint.save`) writes into ``DIR/.partial-step-00000012`` and makes it visible as
``DIR/step-00000012`` with one rename, once DCP's files and the manifest (``shardshift.json``)
are all written. So a ``step-*`` directory is complete by construction; what can still go wrong
is outside the protocol: a file deleted, truncated or overwritten later, a directory copied in by
hand, a checkpoint of another run in the same directory. The manifest names the files with their
sizes and CRC-32s, and the run's identity (`RunIdentity`): what must not change for training to
go on as if it had never stopped. `choose` takes the newest checkpoint that is intact, says why it
passed over newer ones, and refuses one of another run naming the first field that differs.

A save directory belongs to one run: `check_save_dir` refuses to save into a directory holding
checkpoints unless the run resumes from it, and `prunable` (``--keep-checkpoints``) only ever
names checkpoints of the same run older than the one just saved, never one it cannot identify.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from pathlib import Path

from shardshift.textfile import FileError, read_json

MANIFEST = "shardshift.json"
DCP_METADATA = ".metadata"
FORMAT = "training-state/1"  # the DCP files hold `TrainingState.tensors()` by key
PARTIAL_PREFIX = ".partial-"
REPLACED_PREFIX = PARTIAL_PREFIX + "replaced-"  # a complete checkpoint, set aside while its step is saved again
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_CRC_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """What a resumed run must share with the run that saved, for its curve to continue exactly:
    the model, the optimizer and its schedule (the LR horizon is `steps`), the data stream (its
    text, seed and batch), and the dtype. Layout and rank count may differ: DCP reshards."""

    model: str
    model_config: dict
    optim: dict  # OptimConfig's fields
    steps: int
    seed: int
    global_batch: int
    dtype: str
    data: str  # the data's identity (`Corpus.digest`: a text file's bytes, a prepared directory's manifest)

    # field -> the flag that sets it, for messages
    FLAGS = {"model": "--model", "model_config": "--model", "optim": "--lr/--warmup/--grad-clip", "steps": "--steps",
             "seed": "--seed", "global_batch": "--global-batch", "dtype": "--dtype", "data": "--data"}

    @classmethod
    def of(cls, cfg, data_digest: str) -> RunIdentity:
        """The identity of a run with configuration `cfg` (a `TrainConfig`) on data of `data_digest`."""
        optim = {f.name: getattr(cfg.optim, f.name) for f in dataclasses.fields(cfg.optim)}
        optim["betas"] = list(optim["betas"])  # as JSON gives it back
        return cls(cfg.model.name, cfg.model.config_dict(), optim, cfg.steps, cfg.seed, cfg.global_batch, cfg.dtype,
                   data_digest)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def difference(self, other: RunIdentity) -> str | None:
        """The first field that differs, said for a user ("--steps is 100 there, 50 here"), or None."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                if field.name == "data":
                    return "--data: the checkpoint was trained on other text (its digest differs)"
                if field.name == "model_config":
                    return f"--model: the checkpoint's model is {theirs}, this run's {mine}"
                return f"{self.FLAGS[field.name]}: {field.name} is {theirs} in the checkpoint, {mine} in this run"
        return None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``shardshift.json`` says of one checkpoint."""

    format: str
    run: RunIdentity
    layout: str  # the layout it was written under
    step: int
    files: dict[str, list[int]]  # name -> [bytes, crc32], every file of the checkpoint but the manifest
    # The tokenizer of the run's prepared data (its entry in the data's manifest; its file, if any, is
    # among `files`); None: the data were a text file, read as bytes.
    tokenizer: dict | None = None
    # The run's configuration as `shardshift train --config` keys (`argv.train_keys`: the flags a
    # TrainConfig holds, under the layout it was saved under, switches aside); None: written before
    # manifests recorded it.
    config: dict | None = None

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """The manifest of checkpoint `path`; ValueError saying, in one line, what is wrong with it."""
        if not (path / MANIFEST).exists():
            raise ValueError(f"it has no {MANIFEST}")
        try:
            data = read_json(path / MANIFEST, None, "a checkpoint's manifest")
        except FileError as err:  # named here as the checkpoint's, with what to do about a damaged one
            raise ValueError(f"its {MANIFEST} cannot be read: {err.problem}; {_DAMAGED}") from None
        if not isinstance(data, dict):
            raise ValueError(f"its {MANIFEST} holds a JSON {type(data).__name__}, not an object; {_DAMAGED}")
        if data.get("format") != FORMAT:
            raise ValueError(f"its {MANIFEST} is of format {data.get('format', 'no format')!r}, not {FORMAT} "
                             "(written by another version of ShardShift, or not by ShardShift: resume with that "
                             "version, or start afresh with --save in a new directory)")
        files = _field(data, "files", lambda v: {str(name): [_whole(size), _whole(crc)] for name, (size, crc)
                                                 in v.items()}, "a mapping of file name to [bytes, CRC-32]")
        run = _field(data, "run", lambda v: RunIdentity(**v), "the run's identity (model, optim, steps, ...)")
        layout = _field(data, "layout", _text, "a layout")
        step = _field(data, "step", _whole, "a step number")
        tokenizer = _field(data, "tokenizer", _entry, "a tokenizer's entry") if data.get("tokenizer") else None
        config = _field(data, "config", _table, "a table of flags") if data.get("config") else None
        return cls(FORMAT, run, layout, step, files, tokenizer, config)

    def write(self, path: Path) -> None:
        data = {"format": self.format, "run": self.run.as_dict(), "layout": self.layout, "step": self.step,
                "files": self.files, "tokenizer": self.tokenizer,
                "config": self.config}
        tmp = path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path / MANIFEST)


_DAMAGED = "the checkpoint is damaged, or was not written by ShardShift: resume from another one, or move it away"


def _field(data: dict, key: str, convert, expected: str):
    """``convert(data[key])``; ValueError naming the manifest's key if it is missing or not `expected`."""
    if key not in data:
        raise ValueError(f"its {MANIFEST} lacks {key!r}; {_DAMAGED}")
    try:
        return convert(data[key])
    except (AttributeError, TypeError, ValueError):
        shown = repr(data[key])
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"its {MANIFEST} has {key!r} = {shown}, not {expected}; {_DAMAGED}") from None


def _whole(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


def _entry(value) -> dict:
    if not isinstance(value, dict) or not {"kind", "vocab_size", "eod"} <= value.keys():
        raise TypeError(value)
    return value


def _table(value) -> dict:
    if not isinstance(value, dict):
        raise TypeError(value)
    return value


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def file_table(path: Path, rank: int = 0, world: int = 1) -> dict[str, list[int]]:
    """[bytes, crc32] of the files of checkpoint `path` (but the manifest) that are share `rank` of
    `world`: the files go, largest first, each to the share with the fewest bytes so far, so the
    `world` shares together are every file, and each rank reads about an equal part."""
    files = [(f.stat().st_size, f.name) for f in path.iterdir() if f.is_file() and not f.name.startswith(MANIFEST)]
    loads = [0] * world
    mine = {}
    for size, name in sorted(files, key=lambda item: (-item[0], item[1])):
        share = loads.index(min(loads))
        loads[share] += size
        if share == rank:
            mine[name] = [size, crc32(path / name)]
    return dict(sorted(mine.items()))


def crc32(file: Path) -> int:
    value = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def check_intact(path: Path) -> Manifest:
    """The manifest of `path` if every file it names is there with its size and CRC-32; else
    ValueError saying which file is not."""
    manifest = Manifest.read(path)
    if DCP_METADATA not in manifest.files:
        raise ValueError(f"its {MANIFEST} lists no {DCP_METADATA}")
    for name, (size, crc) in manifest.files.items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"its file {name} is missing")
        if file.stat().st_size != size:
            raise ValueError(f"its file {name} has {file.stat().st_size} bytes, not the {size} it was written with")
        if crc32(file) != crc:
            raise ValueError(f"its file {name} is not what was written (CRC-32 differs)")
    return manifest


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint a resume takes (None: there is none), and those it passed over, with why."""

    path: Path | None
    manifest: Manifest | None
    skipped: tuple[tuple[Path, str], ...]

    def describe(self) -> str:
        lines = [f"skipped {path}: {why}" for path, why in self.skipped]
        if self.path is not None:
            lines.append(f"resuming from {self.path} (step {self.manifest.step}, saved under {self.manifest.layout})")
        return "\n".join(lines)


def checkpoints(root: Path) -> list[Path]:
    """The ``step-*`` checkpoints of a save directory, newest first."""
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name, reverse=True)


def step_of(path: Path) -> int:
    """The step of checkpoint directory `path` (``step-*``, or one of its ``.partial-*`` names)."""
    return int(path.name.rsplit("-", 1)[1])


def _set_aside(root: Path) -> list[Path]:
    """Complete checkpoints a save of the same step set aside and a crash left there: the
    ``step-*`` they replace is not there (`checkpoint._publish` renames the new one in next)."""
    found = [p for p in root.glob(REPLACED_PREFIX + "step-*") if p.is_dir() and _STEP_DIR.match(p.name[len(REPLACED_PREFIX):])]
    return [p for p in found if not (root / p.name[len(REPLACED_PREFIX):]).exists()]


def check_save_dir(save: str, resume_from: str | None) -> None:
    """ValueError if a run that resumes from `resume_from` (None: starts afresh) must not save
    into `save`: it holds checkpoints, and the run does not go on from them, so its saves would
    replace them and ``--keep-checkpoints`` would remove them."""
    root = Path(save)
    found = checkpoints(root)
    if not found:
        return
    if resume_from is not None:
        source = Path(resume_from).resolve()
        if root.resolve() in (source, source.parent):
            return
    how = "a run that does not resume from it" if resume_from is None else f"a run resuming from {resume_from}"
    raise ValueError(f"--save {save} holds checkpoints already (newest {found[0].name}), which {how} would "
                     "replace: go on from them with --resume auto, or --save into a new directory")


def prunable(root: Path, run: RunIdentity, step: int, keep: int) -> list[Path]:
    """What ``--keep-checkpoints keep`` removes once step `step` is saved in `root`: checkpoints of
    `run` older than `step`, beyond the `keep - 1` newest of them. Checkpoints of later steps (left
    by a run resumed from an earlier one) and those whose manifest cannot be read or names another
    run are never removed."""
    older = [p for p in checkpoints(root) if step_of(p) < step]
    ours = []
    for path in older:
        try:
            if Manifest.read(path).run == run:
                ours.append(path)
        except ValueError:
            continue
    return ours[max(keep - 1, 0):]


def choose(where: str, run: RunIdentity | None, missing_ok: bool = False) -> Choice:
    """The checkpoint `--resume where` takes for `run`: `where` itself if it is one, else the
    newest intact ``step-*`` in it. Unfinished saves and damaged checkpoints are passed over (the
    choice says why); the checkpoint taken must be of the same run (of any run for None), else
    ValueError naming the field that differs. With `missing_ok` (``--resume auto``), no checkpoint at all (unfinished
    saves aside) is a choice of None; checkpoints none of which is intact are still a ValueError:
    starting afresh would go on to replace them."""
    root = Path(where)
    flag = f"--resume {where}"
    if root.exists() and not root.is_dir():
        raise ValueError(f"{flag}: a file, not a directory; give a --save directory of an earlier run")
    if not root.is_dir():
        if missing_ok:
            return Choice(None, None, ())
        raise ValueError(f"{flag}: no such directory; give a --save directory of an earlier run")
    if (root / MANIFEST).exists() or (root / DCP_METADATA).exists():
        candidates = [root]
    else:
        candidates = sorted(checkpoints(root) + _set_aside(root), key=step_of, reverse=True)
    skipped = [(p, "an unfinished save (the job stopped while writing it)")
               for p in sorted(root.glob(PARTIAL_PREFIX + "step-*"))]
    for path in candidates:
        try:
            manifest = check_intact(path)
        except ValueError as err:
            skipped.append((path, str(err)))
            continue
        other = None if run is None else run.difference(manifest.run)
        if other is not None:
            raise ValueError(f"{flag}: {path} was saved by another run: {other}. Resume with the same "
                             "settings, or --save into a new directory")
        return Choice(path, manifest, tuple(skipped))
    if missing_ok and not candidates:
        return Choice(None, None, tuple(skipped))
    if len(skipped) == 1 and not (missing_ok and candidates):  # one line: the checkpoint and why
        path, reason = skipped[0]
        raise ValueError(f"{flag}: no complete checkpoint in it: {path.name}: {reason}")
    why = "".join(f"\n  {p}: {reason}" for p, reason in skipped)
    hint = "\n  repair them, or move them away to start afresh" if missing_ok and candidates else ""
    raise ValueError(f"{flag}: no complete checkpoint in it{':' if why else ''}{why}{hint}")
