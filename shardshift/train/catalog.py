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
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from pathlib import Path

MANIFEST = "shardshift.json"
DCP_METADATA = ".metadata"
FORMAT = "training-state/1"  # the DCP files hold `TrainingState.tensors()` by key
PARTIAL_PREFIX = ".partial-"
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
    data: str  # digest of the token stream's bytes (`data.digest`)

    # field -> the flag that sets it, for messages
    FLAGS = {"model": "--model", "model_config": "--model", "optim": "--lr/--warmup/--grad-clip", "steps": "--steps",
             "seed": "--seed", "global_batch": "--global-batch", "dtype": "--dtype", "data": "--data"}

    @classmethod
    def of(cls, cfg, data_digest: str) -> RunIdentity:
        """The identity of a run with configuration `cfg` (a `TrainConfig`) on data of `data_digest`."""
        model = {k: getattr(cfg.model, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "d_ff", "vocab_size")}
        optim = {f.name: getattr(cfg.optim, f.name) for f in dataclasses.fields(cfg.optim)}
        optim["betas"] = list(optim["betas"])  # as JSON gives it back
        return cls(cfg.model_name, model, optim, cfg.steps, cfg.seed, cfg.global_batch, cfg.dtype, data_digest)

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

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """The manifest of checkpoint `path`; ValueError saying what is wrong with it."""
        try:
            data = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            raise ValueError(f"it has no {MANIFEST}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"its {MANIFEST} cannot be read ({err})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format", "no format") if isinstance(data, dict) else "not a JSON object"
            raise ValueError(f"its {MANIFEST} is of format {found!r}, not {FORMAT} (written by another "
                             "version of ShardShift, or not by ShardShift)")
        try:
            return cls(FORMAT, RunIdentity(**data["run"]), str(data["layout"]), int(data["step"]), dict(data["files"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"its {MANIFEST} lacks or garbles {err}") from None

    def write(self, path: Path) -> None:
        data = {"format": self.format, "run": self.run.as_dict(), "layout": self.layout, "step": self.step,
                "files": self.files}
        tmp = path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path / MANIFEST)


def file_table(path: Path) -> dict[str, list[int]]:
    """[bytes, crc32] of every file of checkpoint `path` (but the manifest)."""
    return {f.name: [f.stat().st_size, crc32(f)] for f in sorted(path.iterdir())
            if f.is_file() and not f.name.startswith(MANIFEST)}


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


def choose(where: str, run: RunIdentity, missing_ok: bool = False) -> Choice:
    """The checkpoint `--resume where` takes for `run`: `where` itself if it is one, else the
    newest intact ``step-*`` in it. Unfinished saves and damaged checkpoints are passed over (the
    choice says why); the checkpoint taken must be of the same run, else ValueError naming the
    field that differs. With `missing_ok` (``--resume auto``), no checkpoint is a choice of None."""
    root = Path(where)
    flag = f"--resume {where}"
    if root.exists() and not root.is_dir():
        raise ValueError(f"{flag}: a file, not a directory; give a --save directory of an earlier run")
    if not root.is_dir():
        if missing_ok:
            return Choice(None, None, ())
        raise ValueError(f"{flag}: no such directory; give a --save directory of an earlier run")
    candidates = [root] if (root / MANIFEST).exists() or (root / DCP_METADATA).exists() else checkpoints(root)
    skipped = [(p, "an unfinished save (the job stopped while writing it)")
               for p in sorted(root.glob(PARTIAL_PREFIX + "step-*"))]
    for path in candidates:
        try:
            manifest = check_intact(path)
        except ValueError as err:
            skipped.append((path, str(err)))
            continue
        other = run.difference(manifest.run)
        if other is not None:
            raise ValueError(f"{flag}: {path} was saved by another run: {other}. Resume with the same "
                             "settings, or --save into a new directory")
        return Choice(path, manifest, tuple(skipped))
    if missing_ok:
        return Choice(None, None, tuple(skipped))
    why = "".join(f"\n  {p}: {reason}" for p, reason in skipped)
    raise ValueError(f"{flag}: no complete checkpoint in it{':' if why else ''}{why}")
