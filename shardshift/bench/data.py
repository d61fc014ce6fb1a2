"""`shardshift bench data`: how fast data is prepared and read back in training, each beside a
reference measured in the same run.

    shardshift bench data                                   # a generated 32 MiB JSON lines corpus, bpe:4096
    shardshift bench data --input 'dumps/*.jsonl' --tokenizer hf:models/qwen3 --nproc 2 --model tiny

1. **Prepare**, in this process: `prepare` of the input into a new directory, timed whole
   (reading, tokenizing, writing and syncing the shards), beside `tokenizers`' own
   ``encode_batch_fast`` (the call `prepare` makes) of the same tokenizer.json on the same
   documents in the same batches (`prepare.batches`), timed alone: the documents are read before,
   the ids are not converted and nothing is written. With ``bpe:N`` the prepare is timed twice:
   training included (``prepare``), and encoding only, with ``hf:`` the trained tokenizer.json
   (``prepare_encode``), which is what stands beside tokenizers. Rates are MB/s (10**6 bytes) of
   input files. In each round the variants run in turn, in reverse order every other round (the
   first round trains the tokenizer the others use). ``ids_agree``: the prepared stream has as
   many tokens as tokenizers gave ids (``bytes``: as the documents have UTF-8 bytes) plus one end
   per document, and with ``bpe:N`` both prepares wrote the same shards.
2. **Training**, on `nproc` ranks: the same job trained from the prepared directory (``shards``:
   `Trainer` reads it through `ShardFiles`, ``pread`` per window) and from an array in memory of
   the same ids (``memory``: a `Corpus` of a `TokenArray`). Both trainers live in the same
   processes and take turns step by step (each going first in every other pair), each step timed
   between barriers: `warmup` untimed steps of each, then `rounds` rounds of `steps` steps of
   each. They train the same model from the same seed on the same batches in the same order, so
   their losses must be equal (``loss_mismatches``: 0 is the only correct value).

Each rate is the median of the rounds, with the least and the most; a ratio is the median of the
rounds' ratios, each of two variants measured in the same round, with the least and the most.

The launcher does the prepare part in a temporary directory, keeps the last ``prepare``'s output
there for the ranks (``--workdir``, which the launcher adds to their command line), and prints the
report once rank 0 has written its figures there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardshift.bench.calibration import usable_cores
from shardshift.console import say
from shardshift.data.corpus import ShardFiles, TokenArray, load_tokens, open_corpus, vocabulary
from shardshift.data.manifest import DataManifest
from shardshift.data.prepare import batches, find_inputs, prepare, read_documents
from shardshift.data.stream import BatchStream
from shardshift.data.tokenizer import check_bpe_spec, tokenizer_from_flag
from shardshift.models import model_spec
from shardshift.runtime import run_in_group
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer

DEFAULT_CORPUS_BYTES = 32 << 20
DOCUMENT_CHARS = (512, 8192)  # a generated document's length, drawn uniformly between these
DATA = "data"  # the prepared directory the ranks train from, in the work directory
FIGURES = "training.json"  # what rank 0 measured, in the work directory


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataBenchOptions:
    """What `shardshift bench data` runs; validated when built (ValueError says what to change)."""

    inputs: tuple[str, ...] = ()  # --input; none: a generated corpus of `corpus_bytes`
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    tokenizer: str = "bpe:4096"
    field: str = "text"  # of each JSON line
    model: str = "tiny"  # --model; it takes the prepared data's vocabulary (`config`)
    base: TrainConfig  # the training part's layout, batch, dtype, seed and steps; its model is `config`'s
    nproc: int = 2
    steps: int = 10  # timed training steps per variant per round
    rounds: int = 3  # of both parts
    warmup: int = 2  # untimed training steps per variant first
    timeout_s: float = 600.0
    json: bool = False
    workdir: Path | None = None  # on the ranks: the launcher's directory of the prepared data

    def __post_init__(self) -> None:
        for name in ("steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup} must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s} must be > 0 seconds")
        if self.corpus_bytes < 1:
            raise ValueError(f"--corpus-size {self.corpus_bytes} must be at least 1 byte; give e.g. 32M")
        self.base.layout.check_world(self.nproc)
        if self.base.steps < self.warmup + self.steps * self.rounds:
            raise ValueError(f"the run's --steps {self.base.steps} is shorter than the bench's "
                             f"{self.warmup + self.steps * self.rounds} steps per variant")
        if self.inputs:
            find_inputs(self.inputs)  # a FileError naming --input
        if self.trained:
            check_bpe_spec(self.tokenizer)
        else:
            tokenizer_from_flag(self.tokenizer)  # bytes, or an hf: file that loads

    @property
    def trained(self) -> bool:
        return self.tokenizer.startswith("bpe:")

    def config(self, data: Path) -> TrainConfig:
        """The training part's configuration: `base`, reading the prepared directory `data`, its
        model taking the data's vocabulary."""
        return dataclasses.replace(self.base, model=model_spec(self.model, vocabulary(str(data))), data=str(data))


@dataclasses.dataclass(frozen=True)
class Rate:
    """One variant's rate in each round (`rounds`), and their median, least and most."""

    name: str
    what: str
    unit: str  # "MB/s" (of input files) or "tokens/s"
    rounds: tuple[float, ...]
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, name: str, what: str, unit: str, rounds: Sequence[float]) -> Rate:
        return cls(name, what, unit, tuple(rounds), statistics.median(rounds), min(rounds), max(rounds))


@dataclasses.dataclass(frozen=True)
class Ratio:
    """`numerator`'s rate ÷ `denominator`'s, round by round (`rounds`), and their median, least
    and most."""

    numerator: str
    denominator: str
    rounds: tuple[float, ...]
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, a: Rate, b: Rate) -> Ratio:
        rounds = [x / y for x, y in zip(a.rounds, b.rounds)]
        return cls(a.name, b.name, tuple(rounds), statistics.median(rounds), min(rounds), max(rounds))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareFigures:
    """The prepare part: its input, what it gave, and the rates."""

    inputs: tuple[str, ...]  # the files read (for the generated corpus, what it is)
    input_bytes: int
    documents: int
    tokens: int  # of the prepared stream, an end-of-document id after every document
    tokenizer: str  # --tokenizer
    rates: tuple[Rate, ...]  # prepare, (bpe:) prepare_encode, (but bytes) tokenizers
    ratio: Ratio | None  # the prepare that only encodes ÷ tokenizers (None for bytes: no tokenizers)
    ids_agree: bool  # see the module docstring


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingFigures:
    """The training part: the job, the rates of its two readings of the data, and their ratio."""

    model: str
    layout: str
    nproc: int
    device: str
    global_batch: int
    tokens_per_step: int
    steps: int  # timed, per variant per round
    rates: tuple[Rate, ...]  # shards, memory
    ratio: Ratio  # shards ÷ memory
    loss_mismatches: int  # steps whose losses differ between the variants: 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataBenchResult:
    """What ``--json`` prints."""

    cores: int  # the processors this process may run on
    rounds: int
    prepare: PrepareFigures
    training: TrainingFigures

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- the prepare part, in the launcher -------------------------------------------------------------

def write_corpus(path: Path, size: int, seed: int = 0) -> Path:
    """A JSON lines file of at least `size` bytes, ``{"text": ...}`` a line: documents of
    `DOCUMENT_CHARS` characters cut from the shipped corpus at places drawn from `seed`."""
    text = load_tokens(None).tobytes().decode("utf-8")
    rng = np.random.default_rng(seed)
    written = 0
    with open(path, "w", encoding="ascii") as f:
        while written < size:
            length = int(rng.integers(DOCUMENT_CHARS[0], DOCUMENT_CHARS[1] + 1))
            start = int(rng.integers(0, len(text) - length))
            line = json.dumps({"text": text[start:start + length]}) + "\n"  # ASCII: a character is a byte
            f.write(line)
            written += len(line)
    return path


def measure_prepare(opts: DataBenchOptions, inputs: Sequence[str], work: Path) -> tuple[PrepareFigures, Path]:
    """The prepare part (see the module docstring), in `work`; its figures and the directory the
    last round's ``prepare`` wrote."""
    sources = find_inputs(inputs)
    input_bytes = sum(source.size for source in sources)
    documents = list(batches(read_documents(sources, opts.field)))  # tokenizers' input, read before
    spec, trained_json = opts.tokenizer, work / "tokenizer.json"
    names = ["prepare", *(["prepare_encode"] if opts.trained else []), *(["tokenizers"] if spec != "bytes" else [])]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, Path] = {}
    encoder = None
    # The ids tokenizers gave (bytes: the documents' UTF-8 bytes), to compare with the prepared stream.
    ids = sum(len(document.encode("utf-8")) for batch in documents for document in batch) if spec == "bytes" else 0
    for round_ in range(opts.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            if name == "tokenizers":
                ids = sum(sum(map(len, encoder(batch))) for batch in documents)  # len: no ids converted
                seconds[name].append(time.perf_counter() - start)
                continue
            out = work / f"{name}-{round_}"
            prepare(inputs, f"hf:{trained_json}" if name == "prepare_encode" else spec, out, field=opts.field,
                    progress=False)
            seconds[name].append(time.perf_counter() - start)
            if name in outputs:
                shutil.rmtree(outputs[name])
            outputs[name] = out
            if encoder is None and spec != "bytes":
                if opts.trained:
                    shutil.copyfile(out / "tokenizer.json", trained_json)
                encoder = _tokenizers_encoder(f"hf:{trained_json}" if opts.trained else spec)
    train = DataManifest.read(outputs["prepare"]).split("train")
    agree = ids + train.documents == train.tokens
    if opts.trained:
        encoded = DataManifest.read(outputs["prepare_encode"]).split("train")
        agree = agree and [s.digest for s in encoded.shards] == [s.digest for s in train.shards]
    whats = {"prepare": f"prepare --tokenizer {spec}" + (", training included" if opts.trained else ""),
             "prepare_encode": "prepare --tokenizer hf: the trained tokenizer.json, encoding only",
             "tokenizers": "tokenizers' encode_batch_fast of the same batches, no files"}
    rates = {name: Rate.of(name, whats[name], "MB/s", [input_bytes / 1e6 / t for t in times])
             for name, times in seconds.items()}
    ratio = Ratio.of(rates.get("prepare_encode", rates["prepare"]), rates["tokenizers"]) if "tokenizers" in rates else None
    shown = tuple(inputs) if opts.inputs else (f"generated JSON lines: documents of {DOCUMENT_CHARS[0]:,}-"
                                               f"{DOCUMENT_CHARS[1]:,} characters cut from the shipped corpus",)
    figures = PrepareFigures(inputs=shown, input_bytes=input_bytes, documents=train.documents, tokens=train.tokens,
                             tokenizer=spec, rates=tuple(rates.values()), ratio=ratio, ids_agree=agree)
    return figures, outputs["prepare"]


def _tokenizers_encoder(spec: str) -> Callable[[list[str]], list]:
    """tokenizers' own batch encoding with the tokenizer.json ``--tokenizer`` `spec` names, set as
    `prepare` sets it (a special token's name in a document is text)."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tokenizer_from_flag(spec).json_text)
    backend.encode_special_tokens = True
    return lambda batch: backend.encode_batch_fast(batch, add_special_tokens=False)


def check_trainable(opts: DataBenchOptions, data: Path) -> None:
    """Refuse, naming what to change, prepared data too short for one global batch."""
    cfg = opts.config(data)
    corpus = open_corpus(cfg.data)
    try:
        BatchStream(corpus.train, cfg.model.seq_len, cfg.global_batch, cfg.seed, "the prepared input")
    except ValueError as err:
        given = "--input" if opts.inputs else f"--corpus-size {opts.corpus_bytes}"
        raise ValueError(f"{given}: {err}") from None


def run(opts: DataBenchOptions, argv: list[str]) -> int:
    """The bench: the prepare part here, then the training part on `nproc` ranks, each running
    ``shardshift <argv> --workdir DIR`` (`run_rank`); prints the report. The job's exit status."""
    from shardshift.launch import launch

    with tempfile.TemporaryDirectory(prefix="shardshift-bench-data-") as tmp:
        work = Path(tmp)
        came: list[int] = []
        with _stopped_by_signals(came):  # SIGTERM or SIGHUP while preparing: the directory is removed
            try:
                inputs = opts.inputs or (str(write_corpus(work / "corpus.jsonl", opts.corpus_bytes)),)
                prepared, data = measure_prepare(opts, inputs, work)
            except KeyboardInterrupt:
                signum = came[0] if came else signal.SIGINT
                say(f"shardshift: bench data stopped by {signal.Signals(signum).name}", "stderr")
                return 128 + signum
        data.rename(work / DATA)
        check_trainable(opts, work / DATA)
        code = launch(opts.nproc, [*argv, "--workdir", str(work)], preload=(__name__,), timeout_s=opts.timeout_s)
        if code != 0:
            return code
        training = json.loads((work / FIGURES).read_text())
    report(opts, prepared, _training_figures(opts, training))
    return 0


@contextlib.contextmanager
def _stopped_by_signals(came: list[int]):
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread (noted in `came`) while inside."""
    def stop(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


# ---- the training part, on the ranks ---------------------------------------------------------------

def run_rank(opts: DataBenchOptions) -> int:
    """One rank's part of the training measurement; rank 0 writes the figures for the launcher."""
    assert opts.workdir is not None, "a rank of bench data runs in the launcher's work directory"
    proc, measured = run_in_group(opts.timeout_s, lambda proc: measure_training(opts, proc.rank, proc.device_type))
    if proc.rank == 0:
        (opts.workdir / FIGURES).write_text(json.dumps({**measured, "device": proc.device_type}))
    return 0


def measure_training(opts: DataBenchOptions, rank: int, device_type: str) -> dict:
    """Both trainers, in turns (see the module docstring): each variant's seconds per round and the
    steps whose losses differ."""
    cfg = opts.config(opts.workdir / DATA)
    shards = Trainer(cfg, rank, device_type, timeout_s=opts.timeout_s)  # opens the directory itself
    files = shards.corpus.train
    assert isinstance(files, ShardFiles), type(files)
    ids = np.concatenate([np.fromfile(path, dtype=files.dtype) for path in files.paths])
    in_memory = dataclasses.replace(shards.corpus, train=TokenArray(ids), val=None)
    variants = {"shards": shards, "memory": Trainer(cfg, rank, device_type, corpus=in_memory, timeout_s=opts.timeout_s)}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cuda = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    for _ in range(opts.warmup):
        for name, trainer in variants.items():
            losses[name].append(trainer.train_step().loss)
    for _ in range(opts.rounds):
        spent = dict.fromkeys(variants, 0.0)
        for step in range(opts.steps):
            # ABBA: each variant goes first in every other pair of steps.
            for name, trainer in list(variants.items())[::1 if step % 2 == 0 else -1]:
                dist.barrier()
                start = time.perf_counter()
                losses[name].append(trainer.train_step().loss)
                if cuda is not None:
                    torch.cuda.synchronize(cuda)  # the step's kernels done, not only queued
                dist.barrier()
                spent[name] += time.perf_counter() - start
        for name in variants:
            seconds[name].append(spent[name])
    mismatches = sum(a != b for a, b in zip(losses["shards"], losses["memory"]))
    return {"seconds": seconds, "loss_mismatches": mismatches, "model": cfg.model.name,
            "tokens_per_step": cfg.tokens_per_step}


def _training_figures(opts: DataBenchOptions, measured: dict) -> TrainingFigures:
    """The training part's figures from what rank 0 measured (`measure_training`)."""
    per_step = measured["tokens_per_step"]
    whats = {"shards": "from the prepared directory (ShardFiles: pread per window)",
             "memory": "from memory (the same ids in a TokenArray)"}
    rates = tuple(Rate.of(name, whats[name], "tokens/s", [opts.steps * per_step / t for t in measured["seconds"][name]])
                  for name in ("shards", "memory"))
    return TrainingFigures(model=measured["model"], layout=str(opts.base.layout), nproc=opts.nproc,
                           device=measured["device"], global_batch=opts.base.global_batch, tokens_per_step=per_step,
                           steps=opts.steps, rates=rates, ratio=Ratio.of(*rates),
                           loss_mismatches=measured["loss_mismatches"])


# ---- the report -----------------------------------------------------------------------------------

def report(opts: DataBenchOptions, prepared: PrepareFigures, training: TrainingFigures) -> dict:
    """Print the figures: one JSON object, or the tables. Returns that object (what ``--json`` prints)."""
    result = DataBenchResult(cores=usable_cores(), rounds=opts.rounds, prepare=prepared, training=training).as_dict()
    if opts.json:
        print(json.dumps(result))
        return result
    print(f"prepare: {prepared.input_bytes / 1e6:,.1f} MB of input ({', '.join(prepared.inputs)}), "
          f"{prepared.documents:,} documents, {prepared.tokens:,} tokens, --tokenizer {prepared.tokenizer}; "
          f"{opts.rounds} rounds on {result['cores']} cores; median (min-max)")
    for rate in prepared.rates:
        print(f"  {rate.what:<72}{_spread(rate, '.1f')} {rate.unit}")
    if prepared.ratio is not None:
        label = f"{prepared.ratio.numerator} ÷ {prepared.ratio.denominator}"
        print(f"  {label:<72}{_spread(prepared.ratio, '.2f')}")
    print(f"  the ids agree: {'yes' if prepared.ids_agree else 'NO'}")
    print(f"training: model {training.model}, {training.layout} on {training.nproc} {training.device} ranks, "
          f"global batch {training.global_batch}, {training.steps} steps per variant per round; median (min-max)")
    for rate in training.rates:
        print(f"  {rate.what:<72}{_spread(rate, ',.0f')} {rate.unit}")
    print(f"  {'shards ÷ memory':<72}{_spread(training.ratio, '.3f')}")
    print(f"  steps whose losses differ: {training.loss_mismatches}")
    return result


def _spread(figure: Rate | Ratio, spec: str) -> str:
    return f"{figure.median:{spec}} ({figure.min:{spec}}-{figure.max:{spec}})"
