"""Bad input on the command line gets one line saying what to change and exit status 2, before any
process starts (these tests run `main` in the test process; no launcher is reached)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import sys

import pytest

from shardshift.cli.main import main
from support import EXAMPLE_MODEL
from support.cli import forbid_processes


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    forbid_processes(monkeypatch)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc", "4", "--layout", "dp=3"], "layout dp=3 has 3 ranks .* but 4 processes"),
        (["--nproc", "3", "--layout", "tp=3"], "tp=3 does not divide n_head=8"),
        (["--nproc", "16", "--layout", "pp=16"], "pp=16 is larger than the number of layers n_layer=8"),
        (["--layout", "xp=2"], "unknown axis 'xp'"),
        (["--layout", "dp=-1"], "dp=-1"),
        (["--layout", "dp=2", "--global-batch", "1"], "--global-batch 1 leaves some of the dp\\*fsdp=2 data ranks"),
        (["--dtype", "float16"], "--dtype 'float16' is not supported"),
        (["--model", "huge"], "--model 'huge' is unknown"),
        (["--steps", "0"], "--steps 0 must be >= 1"),
        (["--resume", "/nonexistent/ckpt"], "--resume /nonexistent/ckpt: no such directory"),
        (["--data", "/nonexistent/text.txt"], "--data /nonexistent/text.txt: no such file"),
        (["--nproc", "0"], "--nproc 0 must be >= 1"),
        (["--switch", "fsdp=4"], "--switch 'fsdp=4' is not STEP:LAYOUT"),
        (["--switch", "10:dp=2"], "--switch 10:dp=2 has 2 ranks but the job has 4"),
        (["--switch", "10:tp=3,dp=1"], "unknown axis|has 3 ranks"),
        (["--switch", "10:pp=4", "--global-batch", "4"], "--switch 10:pp=4: .*micro-batches|--switch 10:pp=4"),
        (["--switch", "60:fsdp=4"], "switch steps must increase and lie in \\[1, --steps 50\\]"),
        (["--switch", "20:fsdp=4", "--switch", "10:dp=4"], "switch steps must increase"),
        (["--nproc", "3", "--layout", "dp=3", "--global-batch", "3", "--switch", "10:tp=3"],
         "--switch 10:tp=3: tp=3 does not divide n_head=8"),
        (["--switch-budget", "1K"], "--switch-budget 1024 bytes is too small"),
        (["--topology", "ring"], "--topology describes the network the trees are packed on: give --collectives trees"),
        (["--collectives", "trees", "--topology", "/nonexistent.yaml"], "--topology: topology '/nonexistent.yaml'"),
        (["--collectives", "trees", "--topology", "dgx1v:0,1"], "--topology: .* has 2 ranks but the group has 4"),
        (["--collectives", "trees", "--topology", "probe", "--elastic", "--nproc", "2"],
         "--topology probe measures a fixed group; under --elastic give a YAML file"),
        (["--collectives", "trees", "--topology", "docs/topologies/hetero4x.yaml", "--elastic", "--nproc", "2"],
         r"no rank named 127\.0\.0\.1 \(a worker's host\)"),
        (["--run-dir", "/dev/null"], "--run-dir /dev/null: a file is in the way"),
    ],
)
def test_train_refuses_bad_input_before_any_process_starts(args, needle, capsys, monkeypatch):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ")
    assert re.search(needle, err), err


ELASTIC = ["--elastic", "--model", "test", "--global-batch", "6"]


@pytest.mark.parametrize("args, needle", [
    (["--inject", "2:leave=1"], "--inject needs --elastic"),
    (["--layout-for", "3:fsdp=3"], "--layout-for needs --elastic"),
    ([*ELASTIC], "--elastic needs --nproc"),
    ([*ELASTIC, "--nproc", "4", "--inject", "leave=1"], "--inject 'leave=1' is not STEP:join=N"),
    ([*ELASTIC, "--nproc", "4", "--inject", "3:crash=1"], "--inject '3:crash=1' is not STEP:join=N"),
    ([*ELASTIC, "--nproc", "4", "--inject", "0:leave=1"], "the step must be >= 1"),
    ([*ELASTIC, "--nproc", "4", "--inject", "2:leave=1", "--inject", "2:join=1"], "one event per step"),
    ([*ELASTIC, "--nproc", "4", "--min-nproc", "5", "--max-nproc", "6"], "--nproc 4 is outside --min-nproc 5"),
    ([*ELASTIC, "--nproc", "4", "--max-nproc", "3"], "--max-nproc 3 is below --min-nproc 1|outside"),
    ([*ELASTIC, "--nproc", "4", "--min-nproc", "0"], "--min-nproc 0 must be >= 1"),
    ([*ELASTIC, "--nproc", "4", "--layout-for", "3:fsdp=2"], "--layout-for 3:fsdp=2: the layout has 2 ranks, not 3"),
    ([*ELASTIC, "--nproc", "4", "--layout-for", "3"], "--layout-for '3' is not N:LAYOUT"),
    ([*ELASTIC, "--nproc", "4", "--layout-for", "3:tp=3"], "tp=3 does not divide n_head"),
    ([*ELASTIC, "--nproc", "4", "--max-nproc", "7"], "no layout of 7 workers fits .* --layout-for 7:LAYOUT"),
    ([*ELASTIC, "--nproc", "4", "--memory-per-worker", "1K"],
     r"no layout of 4 workers fits \(dp=4: needs .* per rank, above the limit of 1\.0 KiB;.*or allow more memory"),
    ([*ELASTIC, "--nproc", "4", "--memory-per-worker", "0"], "--memory-per-worker '0' must be at least 1 byte"),
    (["--memory-per-worker", "8G"], "--memory-per-worker needs --elastic"),
    ([*ELASTIC, "--nproc", "2", "--switch", "3:tp=2"], "--switch does not go with --elastic"),
    ([*ELASTIC, "--nproc", "2", "--coordinator", "nohost"], "--coordinator 'nohost' is not HOST:PORT"),
    ([*ELASTIC, "--nproc", "4", "--inject", "3:kill=1,1"], "names a rank twice"),
    ([*ELASTIC, "--nproc", "4", "--inject", "3:join=1,2"], "is not STEP:join=N"),
    (["--redundancy", "1"], "--redundancy needs --elastic"),
    ([*ELASTIC, "--nproc", "2", "--redundancy", "-1"], "--redundancy -1 must be >= 0"),
    ([*ELASTIC, "--nproc", "2", "--redundancy", "2"], "--redundancy 2 needs more than 2 workers"),
])
def test_elastic_train_refuses_bad_input_before_any_process_starts(args, needle, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ")
    assert re.search(needle, err), err


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--from", "dp=4", "--to", "dp=3"], "layout dp=3 has 3 ranks"),
    (["--nproc", "8", "--from", "dp=8", "--to", "tp=8"], "tp=8 does not divide n_head=12"),
    (["--nproc", "4", "--from", "dp=4", "--to", "xp=4"], "unknown axis 'xp'"),
    (["--nproc", "4", "--from", "dp=4"], "give --from LAYOUT and --to LAYOUT"),
    (["--nproc", "4", "--suite", "--from", "dp=4", "--to", "tp=4"], "either --suite or --from and --to"),
    (["--nproc", "2", "--suite"], "the default suite is for 4 ranks"),
    (["--nproc", "4", "--suite", "dp=4;dp=4"], "from dp=4 to itself"),
    (["--nproc", "4", "--suite", "dp=4;pp=4", "--global-batch", "4"], "do not split into --micro-batches 8"),
    (["--nproc", "1", "--suite", "dp=1;fsdp=1"], "give --nproc >= 2"),
    (["--nproc", "4", "--suite", "--budget", "1K"], "give at least 4096"),
    (["--nproc", "4", "--suite", "--model", "huge"], "--model 'huge' is unknown"),
])
def test_bench_switch_refuses_bad_input_before_any_process_starts(argv, message, capsys, monkeypatch):
    assert main(["bench", "switch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--op", "allreduce"], "give --nproc N"),
    (["--op", "allreduce", "--nproc", "3", "--emulate"], "--emulate needs a topology"),
    (["--op", "broadcast", "--preset", "dgx1v", "--gpus", "0,1,2", "--nproc", "4"], "topology has 3 ranks"),
    (["--op", "allgather", "--nproc", "2", "--impls", "gloo,nccl"], "choose from gloo, ring, trees, auto"),
    (["--op", "allgather", "--nproc", "2", "--sizes", "0"], "at least 1 byte"),
    (["--op", "allreduce", "--nproc", "2", "--keep", "1.5"], "--keep 1.5: give a fraction in (0, 1]"),
    (["--op", "allreduce", "--nproc", "2", "--max-trees", "0"], "--max-trees 0: give at least 1"),
])
def test_bench_collectives_refuses_bad_input_before_any_process_starts(argv, message, capsys):
    assert main(["bench", "collectives", *argv]) == 2
    assert message in capsys.readouterr().err


def test_train_argv_gives_back_the_configuration_it_was_made_from():
    """The restart baseline of `bench switch` starts `shardshift train` with `train_argv(cfg)`."""
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import config_from_args, train_argv
    from shardshift.layout import Layout
    from shardshift.models import model_spec
    from shardshift.train.config import OptimConfig, TrainConfig

    base = dict(model=model_spec("test"), steps=9, seed=5, dtype="float64", global_batch=8,
                optim=OptimConfig(lr=1e-3, warmup_steps=2, grad_clip=0.5), log_every=3, switch_budget=1 << 20)
    configs = [
        TrainConfig(layout=Layout(fsdp=2, tp=2), stop_at=4, data="corpus.txt", save="ckpt", save_every=2,
                    resume="old", metrics="m.jsonl", tensorboard="tb", switches=((3, Layout(tp=2, pp=2)), (6, Layout(dp=4))),
                    **base),
        TrainConfig(layout=Layout(pp=2, dp=2), micro_batches=4, **base),
        TrainConfig(layout=Layout(pp=2, tp=2), micro_batch_size=2, eval_every=3, eval_batches=2, **base),
        TrainConfig(layout=Layout(dp=4), collectives="trees", topology="ring", **base),
    ]
    for cfg in configs:
        argv = train_argv(cfg, nproc=4, timeout_s=12.5)
        args = build_parser(argv).parse_args(argv)
        assert config_from_args(args, Layout.parse(args.layout)) == cfg, argv
        assert (args.nproc, args.timeout) == (4, 12.5)
    with pytest.raises(ValueError, match="no flag of `shardshift train` sets"):
        train_argv(dataclasses.replace(configs[1], optim=OptimConfig(weight_decay=0.5)), nproc=4, timeout_s=1)


@pytest.mark.parametrize("argv, message", [
    (["--layout", "dp=3", "--also", ""], "layout dp=3 has 3 ranks (product of its degrees) but 4 processes"),
    (["--nproc", "3", "--layout", "tp=3", "--also", ""], "tp=3 does not divide n_head=8"),
    (["--also", "pp=4", "--global-batch", "4"], "do not split into --micro-batches 8"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--model", "huge"], "--model 'huge' is unknown"),
    (["--emulate"], "--emulate needs --topology FILE"),
    (["--topology", "/nonexistent.yaml"], "--topology: topology '/nonexistent.yaml': no file"),
])
def test_bench_train_refuses_bad_input_before_any_process_starts(argv, message, capsys):
    assert main(["bench", "train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and message in err, err


def test_resuming_a_checkpoint_of_another_format_is_refused(tmp_path, capsys):
    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")  # complete, as far as DCP's marker says
    meta = {"model": "tiny", "model_config": {"n_layer": 8, "n_head": 8, "d_model": 128, "seq_len": 128,
            "d_ff": 512, "vocab_size": 256}, "layout": "fsdp=2,tp=2", "step": 3, "global_batch": 16, "seed": 0}
    (step / "shardshift.json").write_text(json.dumps(meta))  # no "format": written before training-state/1
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint in it" in err and "format 'no format', not training-state/1" in err, err


def _files(tmp) -> dict[str, str]:
    """Bad files for the table below, by the name the table uses."""
    files = {"empty": ("empty.txt", b""), "short": ("short.txt", b"far too short for one batch"),
             "binary": ("model.bin", bytes(range(256)) * 64),
             "zipped": ("zipped.txt", gzip.compress(b"To be, or not to be. " * 1000)),
             "badgz": ("bad.gz", b"not gzip at all"), "nul": ("nul.txt", b"text\x00with a NUL" * 100),
             "afile": ("afile", b"a file where a directory belongs"), "badyaml": ("bad.yaml", b"ranks: [0, 1\nlinks: ["),
             "corruptgz": ("corrupt.gz", _corrupt(gzip.compress(b"To be, or not to be. " * 1000)))}
    for name, content in files.values():
        (tmp / name).write_bytes(content)
    (tmp / "dir").mkdir()
    (tmp / "ckpts" / "step-00000002").mkdir(parents=True)  # a save directory another run wrote into
    return {key: str(tmp / name) for key, (name, _) in files.items()} | {"dir": str(tmp / "dir"),
                                                                          "ckpts": str(tmp / "ckpts")}


def _corrupt(gz: bytes) -> bytes:
    """A gzip file whose header is intact and whose compressed data is not."""
    return gz[:10] + b"\xff" * 20 + gz[30:]


BAD_INPUT = [  # argv ({name} is a file of `_files`), what the one-line error must say
    (["train", "--data", "{empty}"], "--data {empty}: the file is empty"),
    (["train", "--mixed-precision", "bf16", "--dtype", "float64"], "--mixed-precision bf16 keeps float32 parameters"),
    (["train", "--compile", "tvm"], "--compile 'tvm': choose a backend of inductor, aot_eager, eager (or none)"),
    (["train", "--data", "{short}"], "--data {short}: the text has 27 bytes"),
    (["train", "--data", "{binary}"], "--data {binary}: not UTF-8 text"),
    (["train", "--data", "{zipped}"], "--data {zipped}: the file is gzip-compressed"),
    (["train", "--data", "{badgz}"], "--data {badgz}: its name ends in .gz but it does not decompress as gzip"),
    (["train", "--data", "{nul}"], "--data {nul}: it holds NUL bytes"),
    (["train", "--data", "{corruptgz}"], "--data {corruptgz}: its name ends in .gz but it does not decompress as gzip"),
    (["train", "--data", "{dir}"], "--data {dir}: a directory with no manifest.json; give a text file or a directory"),
    (["train", "--save", "{ckpts}"], "--save {ckpts} holds checkpoints already (newest step-00000002), which a run "
     "that does not resume from it would replace: go on from them with --resume auto, or --save into a new"),
    (["train", "--save", "{ckpts}", "--resume", "{dir}"], "--save {ckpts} holds checkpoints already"),
    (["train", "--timeout", "0"], "--timeout 0.0 must be > 0"),
    (["train", "--global-batch", "0"], "--global-batch 0 must be >= 1"),
    (["train", "--log-every", "-1"], "--log-every -1 must be >= 0"),
    (["train", "--save", "{afile}"], "--save {afile}: a file is in the way"),
    (["train", "--log-dir", "{afile}"], "--log-dir {afile}: a file is in the way"),
    (["train", "--metrics", "{dir}"], "--metrics {dir}: is a directory"),
    (["train", "--metrics", "{dir}/missing/m.jsonl"], "--metrics {dir}/missing/m.jsonl: no directory"),
    (["train", "--tensorboard", "{afile}"], "--tensorboard {afile}: a file is in the way; give a directory"),
    (["train", "--tensorboard", "{afile}/tb"], "--tensorboard {afile}/tb: cannot create the directory (Not a directory)"),
    (["train", "--tensorboard", ""], "--tensorboard '' names no directory"),
    (["train", "--elastic", "--nproc", "2", "--tensorboard", "{afile}"], "--tensorboard {afile}: a file is in the way"),
    (["train", "--resume", "{afile}"], "--resume {afile}: a file, not a directory"),
    (["train", "--resume", "{dir}"], "--resume {dir}: no complete checkpoint"),
    (["train", "--resume", "auto"], "--resume auto resumes from --save's directory: give --save DIR"),
    (["train", "--keep-checkpoints", "-1", "--save", "{dir}"], "--keep-checkpoints -1 must be >= 0"),
    (["train", "--keep-checkpoints", "2"], "--keep-checkpoints needs --save DIR"),
    (["train", "--switch-budget", "lots"], "--switch-budget 'lots' is not a number of bytes"),
    (["bench", "train", "--timeout", "0"], "--timeout 0.0 must be > 0"),
    (["bench", "train", "--rounds", "0"], "--rounds 0 must be >= 1"),
    (["bench", "train", "--also", "fsdp=4 --lr 1"], "--also 'fsdp=4 --lr 1': '--lr' is not a flag a row takes"),
    (["bench", "train", "--also", "fsdp=4 --compile tvm"], "--compile 'tvm': choose a backend of"),
    (["bench", "train", "--also", "fsdp=4 --micro-batch-size two"], "--micro-batch-size two is not a whole number"),
    (["bench", "switch", "--suite", "--p2p-size", "0"], "--p2p-size '0' must be at least 1 byte"),
    (["bench", "switch", "--suite", "--timeout", "-1"], "--timeout -1.0 must be > 0"),
    (["bench", "packing", "--ops", "gather"], "--ops gather: unknown collective 'gather'"),
    (["bench", "packing", "--sizes", "x"], "--sizes 'x': give subset sizes"),
    (["bench", "packing", "--limit", "-1"], "--limit -1 must be >= 0"),
    (["bench", "collectives", "--op", "allreduce", "--nproc", "2", "--timeout", "0"], "--timeout 0.0 must be > 0"),
    (["bench", "collectives", "--op", "allreduce", "--nproc", "2", "--window", "0"], "--window 0 must be > 0"),
    (["bench", "collectives", "--op", "allreduce", "--nproc", "2", "--chunk-seconds", "-1"], "--chunk-seconds -1.0"),
    (["bench", "collectives", "--op", "allreduce", "--preset", "full", "--nproc", "2", "--emulate",
      "--emulate-scale", "fast"], "--emulate-scale 'fast' is not a number"),
    (["bench", "collectives", "--op", "allreduce", "--preset", "full", "--nproc", "2", "--emulate",
      "--emulate-scale", "0"], "--emulate-scale 0 must be > 0"),
    (["bench", "collectives", "--op", "allreduce", "--topology", "{badyaml}"], "--topology {badyaml}: not valid YAML"),
    (["bench", "collectives", "--op", "broadcast", "--nproc", "2", "--root", "5"], "--root 5 is not a rank"),
    (["topo", "pack", "--topology", "{badyaml}", "--op", "broadcast"], "--topology {badyaml}: not valid YAML"),
    (["topo", "pack", "--topology", "{dir}/none.yaml", "--op", "broadcast"], "--topology {dir}/none.yaml: no such"),
    (["topo", "pack", "--preset", "ring", "--ranks", "1", "--op", "broadcast"], "--preset ring --ranks 1: n=1"),
    (["topo", "pack", "--preset", "dgx1v", "--gpus", "0,9", "--op", "reduce"], "--preset dgx1v --gpus 0,9: gpu 9"),
    (["topo", "pack", "--preset", "full", "--ranks", "3", "--op", "broadcast", "--root", "7"], "--root 7 is not a rank"),
    (["topo", "pack", "--preset", "full", "--ranks", "3", "--op", "broadcast", "--keep", "0"], "--keep 0.0"),
    (["topo", "show", "--preset", "ring", "--ranks", "3", "--bandwidth", "fast"], "--bandwidth: cannot read rate"),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_every_command_refuses_bad_input_in_one_line(argv, needle, tmp_path, capsys):
    files = _files(tmp_path)
    argv = [arg.format(**files) for arg in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1, err
    assert needle.format(**files) in err, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("argv", [["train"], ["train", "--elastic", "--nproc", "2"]])
def test_tensorboard_without_its_package_is_refused_saying_how_to_install_it(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec finds nothing
    assert main([*argv, "--model", "test", "--global-batch", "4", "--tensorboard", str(tmp_path / "tb")]) == 2
    assert capsys.readouterr().err == ("shardshift: error: --tensorboard needs the tensorboard package: "
                                       "pip install 'shardshift[tensorboard]'\n")
    assert not (tmp_path / "tb").exists()


def test_the_default_switches_belong_to_the_default_job_only():
    """Under torchrun with 2 processes and no --layout, the 4-rank default switches were applied."""
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import DEFAULT_LAYOUT, config_from_args
    from shardshift.layout import Layout

    args = build_parser(["train"]).parse_args(["train", "--model", "test", "--global-batch", "8"])
    assert config_from_args(args, Layout(dp=2)).switches == ()
    assert [layout for _, layout in config_from_args(args, DEFAULT_LAYOUT).switches] == [Layout(tp=2, pp=2), Layout(fsdp=4)]


# ---- files that are not the text they should be -----------------------------------------------------

# Each kind of bad file, and what the one line says is wrong with it.
UNREADABLE = {
    "binary": "not UTF-8 text (byte 128 is 0x80)",
    "latin1": "not UTF-8 text (byte 13 is 0xe9)",
    "nul": "it holds NUL bytes, which text does not",
    "empty": "the file is empty",
    "dir": "a directory",
    "unreadable": "cannot be read (",
    "badyaml": "not valid YAML (expected ',' or ']', but got ':' at line 2, column 6)",
    "badjson": "not valid JSON (Expecting value at line 1, column 17)",
}


def _unreadable(tmp, kind: str, name: str):
    """A file (or directory) called `name` in `tmp` of the kind `kind` of `UNREADABLE`."""
    path = tmp / name
    content = {"binary": bytes(range(256)) * 16, "latin1": "name: lab-caf\xe9\n".encode("latin-1"),
               "nul": b"name: lab\x00\n", "empty": b"", "badyaml": b"ranks: [0, 1\nlinks: [",
               "badjson": b'{"hidden_size": '}.get(kind)
    if kind == "dir":
        path.mkdir()
    elif kind == "unreadable":  # reading it fails with EIO; as root, a mode of 000 would not stop the read
        path.symlink_to("/proc/self/mem")
    else:
        path.write_bytes(content)
    return path


SIMULATE = ["simulate", "switch", "--ranks", "8", "--from", "dp=8", "--to", "tp=8"]
# A command, the name its file gets, the kinds it is tried with, and how the error names the file.
FILE_READERS = [
    (["topo", "pack", "--op", "broadcast", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    (["topo", "show", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    (["topo", "draw", "--op", "allreduce", "-o", "{tmp}/t.png", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    (["bench", "collectives", "--op", "allreduce", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    (["bench", "train", "--topology", "{f}", "--emulate"], "lab.yaml", "--topology {f}: "),
    (["bench", "train", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    (["train", "--collectives", "trees", "--topology", "{f}"], "lab.yaml", "--topology {f}: "),
    ([*SIMULATE, "--model", "llama3-70b", "--cluster", "{f}"], "cluster.yaml", "--cluster {f}: "),
    ([*SIMULATE, "--model", "{f}"], "spec.yaml", "--model {f}: "),
    ([*SIMULATE, "--model", "{f}"], "config.json", "--model {f}: "),
    (["train", "--data", "{f}"], "text.txt", "--data {f}: "),
    (["plot", "{f}", "-o", "{tmp}/run.png"], "run.jsonl", "{f}: "),
]
TEXT_KINDS = ("binary", "latin1", "nul", "empty", "dir", "unreadable")
FILE_CASES = [(argv, name, named, kind) for argv, name, named in FILE_READERS
              for kind in TEXT_KINDS + {".yaml": ("badyaml",), ".json": ("badjson",)}.get(name[name.rfind("."):], ())]


@pytest.mark.parametrize("argv, name, named, kind", FILE_CASES,
                         ids=[f"{' '.join(x for x in a[:2] if x != '{f}')} {n} {k}" for a, n, _, k in FILE_CASES])
def test_a_file_that_is_not_text_is_refused_in_one_line_naming_the_flag_and_the_file(
        argv, name, named, kind, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing is written beside the tests
    path = _unreadable(tmp_path, kind, name)
    argv = [arg.format(f=path, tmp=tmp_path) for arg in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1, err
    assert f"shardshift: error: {named.format(f=path)}{UNREADABLE[kind]}" in err, err
    assert "Traceback" not in out + err


MANIFEST_CASES = [*[(kind, UNREADABLE[kind]) for kind in (*TEXT_KINDS, "badjson")],
                  ("list", "holds a JSON list, not an object"),
                  ("nofiles", "lacks 'files'"),
                  ("badfiles", "has 'files' = 3, not a mapping of file name to [bytes, CRC-32]")]


@pytest.mark.parametrize("command", ["train", "sample"])
@pytest.mark.parametrize("kind, problem", MANIFEST_CASES, ids=[kind for kind, _ in MANIFEST_CASES])
def test_a_checkpoint_whose_manifest_is_not_json_is_refused_naming_the_file(command, kind, problem, tmp_path,
                                                                           capsys):
    """One line: --resume, the directory, the one checkpoint in it, and what is wrong with its manifest."""
    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    shape = {"list": [1, 2], "nofiles": {"format": "training-state/1"},
             "badfiles": {"format": "training-state/1", "run": {}, "layout": "dp=2", "step": 3, "files": 3}}
    if kind in shape:
        (step / "shardshift.json").write_text(json.dumps(shape[kind]))
    else:
        _unreadable(step, kind, "shardshift.json")
    assert main([command, "--resume", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    what = problem if kind in shape else f"cannot be read: {problem}"
    assert err.count("\n") == 1, err
    assert err.startswith(f"shardshift: error: --resume {tmp_path}: no complete checkpoint in it: {step.name}: "
                          f"its shardshift.json {what}"), err
    assert "damaged, or was not written by ShardShift" in err and "Traceback" not in out + err


# ---- prepared data that does not fit the run ---------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, str]:
    """Directories `shardshift data prepare` wrote (a BPE of 300 tokens with a held-out split; bytes
    without one), and damaged copies of the first: a shard changed, a shard cut short."""
    import shutil

    from shardshift.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    text = "".join(f"Line {i}: to be, or not to be, that is the question.\n" for i in range(3000))
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text[i:i + 1500]}) + "\n" for i in range(0, len(text), 1500)))
    prepare([str(docs)], "bpe:300", root / "bpe", val_fraction=0.1)
    prepare([str(docs)], "bytes", root / "bytes")
    shard = "train-00000.tokens"
    for name in ("changed", "short"):
        shutil.copytree(root / "bpe", root / name)
    raw = bytearray((root / "changed" / shard).read_bytes())
    raw[100] ^= 1
    (root / "changed" / shard).write_bytes(bytes(raw))
    (root / "short" / shard).write_bytes((root / "bpe" / shard).read_bytes()[:-2])
    shutil.copytree(root / "bpe", root / "data.partial-123")  # what a killed prepare leaves
    return {name: str(root / name) for name in ("bpe", "bytes", "changed", "short")} | {
        "partial": str(root / "data.partial-123")}


DATA_REFUSALS = [  # argv after `train --steps 1`, what the one line must say ({name}: a directory of `prepared`)
    (["--data", "{bpe}", "--model", EXAMPLE_MODEL],
     "--data {bpe}: its tokenizer has 300 tokens, more than --model " + EXAMPLE_MODEL + "'s vocabulary of 256; "
     "choose a model with vocab_size >= 300, or prepare the data with a tokenizer that fits (--tokenizer bytes)"),
    (["--data", "{bytes}", "--eval-every", "5"], "--eval-every needs a held-out split: --data {bytes} has none; prepare"),
    (["--data", "{bpe}", "--eval-every", "5", "--global-batch", "512", "--model", "test"],
     "--data {bpe}: its held-out split has"),
    (["--data", "{changed}"], "--data {changed}/train-00000.tokens: its digest differs from the manifest's"),
    (["--data", "{short}"], "--data {short}/train-00000.tokens: incomplete"),
    (["--data", "{partial}"], "--data {partial}: a directory with no manifest.json"),
]


@pytest.mark.parametrize("argv, needle", DATA_REFUSALS, ids=["vocabulary", "no-held-out", "held-out-short", "changed",
                                                              "short", "partial"])
def test_prepared_data_that_does_not_fit_the_run_is_refused_in_one_line(argv, needle, prepared, capsys):
    argv = ["train", "--steps", "1", *[arg.format(**prepared) for arg in argv]]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1, err
    assert needle.format(**prepared) in err, err


# ---- --config FILE and --profile -------------------------------------------------------------------

CONFIG_REFUSALS = [  # the file's content (None: no file there), the one line's needle after "--config {f}: "
    (b'globl_batch = 16\n', "unknown key 'globl_batch'; keys are the flags of `shardshift train` with underscores"),
    (b'global-batch = 16\n', "unknown key 'global-batch'; write global_batch"),
    (b'global_batch = "16"\n', 'global_batch = "16" is not an integer; write e.g. global_batch = 16'),
    (b'global_batch = true\n', "global_batch = true is not an integer"),
    (b'lr = "fast"\n', 'lr = "fast" is not a number; write e.g. lr = 0.003'),
    (b'plot = 1\n', "plot = 1 is not true or false; write e.g. plot = true"),
    (b'switch = "20:tp=2,pp=2"\n', 'switch = "20:tp=2,pp=2" is not a list of strings; write e.g. switch = ["..."]'),
    (b'switch = [20]\n', "is not a list of strings"),
    (b'collectives = "nccl"\n', 'collectives = "nccl": choose one of "gloo", "trees"'),
    (b'[train]\nsteps = 3\n', "unknown key 'train'"),
    (b'config = "other.toml"\n', "key 'config': --config is a flag of the command line only"),
    (b'steps = \n', "not valid TOML (Invalid value (at line 1, column 9))"),
    (b'', "the file is empty"),
    (bytes(range(256)), "not UTF-8 text"),
    (None, "no such file"),
]


@pytest.mark.parametrize("content, needle", CONFIG_REFUSALS, ids=[n[:30] for _, n in CONFIG_REFUSALS])
def test_a_config_file_that_is_not_one_is_refused_in_one_line_naming_it_and_the_key(content, needle, tmp_path,
                                                                                     capsys):
    path = tmp_path / "run.toml"
    if content is not None:
        path.write_bytes(content)
    assert main(["train", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"shardshift: error: --config {path}: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("argv, needle", [
    (["--profile", "3"], "--profile '3' is not STEP:STEP"),
    (["--profile", "a:b"], "--profile 'a:b' is not STEP:STEP"),
    (["--profile", "5:3"], "--profile 5:3: step 5 comes after step 3; write --profile 3:5"),
    (["--profile", "0:2"], r"--profile 0:2: the steps must lie in \[1, --steps 50\]"),
    (["--profile", "1:51"], r"--profile 1:51: the steps must lie in \[1, --steps 50\]"),
    (["--nproc", "2", "--model", "test", "--global-batch", "4", "--profile", "1:2"],
     "--profile 1:2 writes a trace per rank into the run's directory: give --run-dir DIR"),
    ([*ELASTIC, "--nproc", "2", "--profile", "1:2"], "--profile traces the steps of a fixed run"),
])
def test_bad_profile_ranges_are_refused_before_any_process_starts(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default job names a run directory here (and makes none when it refuses)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1, err
    assert re.search(needle, err), err
    assert not (tmp_path / "runs").exists()


def _printed_config(argv: list[str], capsys) -> tuple[dict, set[str]]:
    """What `train --print-config` prints: its keys' values, and the keys it says are not set."""
    import tomllib

    assert main(["train", *argv, "--print-config"]) == 0
    out = capsys.readouterr().out
    return tomllib.loads(out), set(re.findall(r"^# (\w+): not set$", out, re.M))


def test_print_config_reads_back_and_names_every_flag(tmp_path, capsys):
    from shardshift.cli.main import build_parser

    values, unset = _printed_config(["--model", "test", "--switch", "3:fsdp=4"], capsys)
    flags = set(vars(build_parser(["train"]).parse_args(["train"]))) - {"command", "func", "config", "print_config"}
    assert values.keys() | unset == flags
    assert not values.keys() & unset
    assert (values["model"], values["switch"], values["steps"], values["plot"]) == ("test", ["3:fsdp=4"], 50, False)
    path = tmp_path / "printed.toml"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items()))  # what it printed, read back
    assert _printed_config(["--config", str(path)], capsys) == (values, unset)


def test_flags_on_the_command_line_override_the_config_file(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nglobal_batch = 8\nswitch = ["2:fsdp=4"]\nlayout_for = ["3:fsdp=3"]\nlr = 1\n'
                    'plot = true\nmetrics = "m.jsonl"\n')
    values, unset = _printed_config(["--config", str(path), "--steps", "3", "--switch", "3:tp=4"], capsys)
    assert (values["steps"], values["switch"], values["global_batch"], values["lr"]) == (3, ["3:tp=4"], 8, 1.0)
    assert (values["layout_for"], values["plot"], values["metrics"]) == (["3:fsdp=3"], True, "m.jsonl")
    values, _ = _printed_config(["--steps", "3", "--config", str(path)], capsys)  # wherever --config stands
    assert values["steps"] == 3


def test_a_config_is_expanded_into_the_flags_the_ranks_parse(tmp_path):
    """The ranks and an elastic job's joiners parse `args.argv`, which names no file: the same values."""
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import apply_config

    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nlayout = "dp=2"\nswitch = ["2:fsdp=2", "4:dp=2"]\nlr = 0.001\nplot = true\n'
                    'data = "-odd name.txt"\ninject = []\n')
    argv = ["train", "--config", str(path), "--seed", "3"]
    args = build_parser(argv).parse_args(argv)
    args.argv = argv
    apply_config(args)
    assert "--config" not in " ".join(args.argv)
    again = build_parser(args.argv).parse_args(args.argv)
    keep = {"config", "print_config", "argv", "func"}
    assert {k: v for k, v in vars(again).items() if k not in keep} == {k: v for k, v in vars(args).items()
                                                                        if k not in keep}
    assert (again.steps, again.seed, again.switch, again.data) == (7, 3, ["2:fsdp=2", "4:dp=2"], "-odd name.txt")


def test_a_manifest_without_a_config_still_reads(tmp_path):
    """Checkpoints written before manifests recorded the configuration resume as before."""
    from shardshift.train.catalog import FORMAT, MANIFEST, Manifest, RunIdentity

    run = RunIdentity("test", {}, {}, 2, 0, 4, "float64", "digest")
    Manifest(FORMAT, run, "dp=2", 2, {}, config={"steps": 2, "layout": "dp=2"}).write(tmp_path)
    assert Manifest.read(tmp_path).config == {"steps": 2, "layout": "dp=2"}
    data = json.loads((tmp_path / MANIFEST).read_text())
    del data["config"]
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    assert Manifest.read(tmp_path) == Manifest(FORMAT, run, "dp=2", 2, {})
