"""`shardshift train`: train a model under a layout on N local processes (or under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardshift.cli import add_device_argument, model_help
from shardshift.layout import Layout
from shardshift.runtime import in_worker, process_from_env, resolve_device
from shardshift.train.argv import flag_keys, given_keys, keys_argv, read_config, to_toml
from shardshift.train.argv import train_argv as train_argv  # the command line of a config; re-exported

DEFAULT_LAYOUT = Layout(fsdp=2, tp=2)
# The default run (no --layout, no --switch) shows online switching: a pipeline from 40% of the
# steps, plain FSDP from 70%.
DEFAULT_SWITCHES = ((0.4, Layout(tp=2, pp=2)), (0.7, Layout(fsdp=4)))


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model under a dp x fsdp x tp x pp layout")
    add_train_arguments(p)
    p.set_defaults(func=run)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="flags from a TOML file: each flag a key named with underscores (global_batch = 16; "
                        "switch = [\"20:tp=2,pp=2\"]; plot = true); flags given on the command line win (docs/config.md)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration (every flag's value, --config's and the command line's) "
                        "as TOML, and exit")
    p.add_argument("--nproc", type=int, default=None, help="local processes to start (default: the layout's size)")
    p.add_argument("--layout", default=None,
                   help=f"degrees, e.g. 'dp=2,tp=2' (axes dp, fsdp, tp, pp; missing ones are 1); "
                        f"default {DEFAULT_LAYOUT} on {DEFAULT_LAYOUT.world_size} processes, dp=N on --nproc N others")
    p.add_argument("--steps", type=int, default=50, help="length of training in steps (the LR schedule's horizon)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step (default: --steps); resume later with --resume")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32, float64 or bfloat16")
    p.add_argument("--model", default="tiny", help=model_help("tiny"))
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all data ranks")
    p.add_argument("--micro-batches", type=int, default=0, help="micro-batches per data rank under pp (default 2*pp)")
    p.add_argument("--micro-batch-size", type=int, default=0, metavar="M",
                   help="at most M sequences in one forward: a rank runs its share of the global batch in as many "
                        "micro-batches as it needs (gradient accumulation; under pp, the pipeline's micro-batches); "
                        "the global batch and the loss stay the same (default: a rank's whole share at once)")
    p.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                   help="recompute each layer's activations in the backward instead of keeping them: full (all "
                        "of the layer), selective (all but its matrix products and attention); default none")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16"],
                   help="bf16: FSDP2 computes and gathers bfloat16 copies of the float32 parameters and reduces "
                        "gradients in float32; bfloat16 autocast elsewhere (default none)")
    p.add_argument("--compile", nargs="?", const="inductor", default="none", metavar="BACKEND",
                   help="compile each layer's forward with torch.compile: inductor (the default backend: generated "
                        "kernels), aot_eager (forward and backward traced, run by eager kernels) or eager; the first "
                        "step after a start, a switch or a change of world compiles, or reuses what this process "
                        "compiled for the same shapes (default: none)")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="every K steps and at the last, the loss on the held-out split of a prepared --data "
                        "(`shardshift data prepare --val-fraction`), in the metrics and the progress line")
    p.add_argument("--eval-batches", type=int, default=4, metavar="B",
                   help="global batches of the held-out split each evaluation reads (default 4)")
    p.add_argument("--data", default=None, help="text file to train on (default: the shipped Shakespeare corpus)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--save", default=None,
                   help="checkpoint directory (DCP) of this run: one holding checkpoints is refused unless the run "
                        "resumes from it")
    p.add_argument("--save-every", type=int, default=0, help="save every K steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=0,
                   help="keep the newest K checkpoints in --save, removing this run's older ones once a newer is "
                        "complete (0: all)")
    p.add_argument("--resume", default=None,
                   help="resume from the newest complete checkpoint in DIR (or that checkpoint), under any layout; "
                        "'auto': from --save's when it has any, else start fresh")
    p.add_argument("--metrics", default=None, help="JSONL file: one object per step")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard event files in DIR: loss, learning rate, gradient norm, tokens/s, memory, "
                        "held-out loss, each switch and change of world (pip install 'shardshift[tensorboard]')")
    p.add_argument("--log-every", type=int, default=1, help="print progress every K steps")
    p.add_argument("--switch", action="append", default=None, metavar="STEP:LAYOUT",
                   help="switch the layout online, in the running processes, before step STEP "
                        "(repeatable), e.g. --switch 20:tp=2,pp=2; the default run switches twice")
    p.add_argument("--switch-budget", default="256M",
                   help="memory a switch may use beyond max(old state, new state), e.g. 64M (default 256M)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails the run")
    p.add_argument("--profile", default=None, metavar="STEP:STEP",
                   help="a torch profiler trace of these steps (inclusive), one Chrome trace per rank, "
                        "profile-rank-N.json, in --run-dir (else beside --metrics)")
    add_device_argument(p)
    p.add_argument("--plot", action="store_true",
                   help="at the end, draw the run (loss, tokens/s, switches) beside --metrics, as .png")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the run's outputs in DIR: metrics.jsonl, its picture metrics.png, the last checkpoint "
                        "in checkpoints/, and a sample of text at the end (the default job: runs/train-TIME)")
    p.add_argument("--collectives", choices=["gloo", "trees"], default="gloo",
                   help="trees: DDP's and FSDP2's collectives on packed trees (the shardshift backend)")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="with --collectives trees: the network (a YAML file, docs/topology.md, or a spec such as "
                        "dgx1v:0,1,2,3 or probe; default full)")
    e = p.add_argument_group("elastic membership (workers join and leave the running job)")
    e.add_argument("--elastic", action="store_true",
                   help="serve a coordinator; workers may join (`shardshift join`) and leave on notice (SIGTERM to "
                        "a worker) while the job trains, and the state moves to the new world in the running processes")
    e.add_argument("--min-nproc", type=int, default=1, help="fewest workers the job trains with (fewer: it stops and saves)")
    e.add_argument("--max-nproc", type=int, default=None,
                   help="most workers (default: --nproc plus the scripted joiners); ready joiners beyond it wait")
    e.add_argument("--layout-for", action="append", default=[], metavar="N:LAYOUT",
                   help="the layout of a world of N workers (repeatable); otherwise the layout policy picks the "
                        "layout predicted to step fastest that fits --memory-per-worker (docs/elastic.md)")
    e.add_argument("--inject", action="append", default=[], metavar="STEP:EVENT",
                   help="a scripted event after step STEP (repeatable): join=N workers, leave=RANK (a real SIGTERM "
                        "to that worker), kill=RANK (a SIGKILL inside the step), term=RANK (a SIGTERM while the next "
                        "change moves the state), movekill=PROCESS (a SIGKILL to that process of the next change as "
                        "the state starts to move: the old world's ranks, then the joiners); all but join take "
                        "several: kill=1,2")
    e.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="where the coordinator serves (default: loopback, a free port)")
    e.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat after which the coordinator takes a worker it started for "
                        "dead, kills it, and the others go on without it (default 5)")
    e.add_argument("--memory-per-worker", default=None, metavar="SIZE",
                   help="memory a worker's state may take (parameters, gradients, AdamW moments, activations, "
                        "copies), e.g. 8G: the layout policy only picks layouts that fit (default: the GPU's memory, "
                        "or this machine's memory divided by --max-nproc)")
    e.add_argument("--redundancy", type=int, default=0, metavar="K",
                   help="keep every piece of the training state on K + 1 workers, in memory and current at every "
                        "step, so that K workers may crash at once and lose nothing (default 0: replicas only)")
    p.add_argument("--log-dir", default=None,
                   help="where ranks 1.. append their output (rank-N.log); default: a temporary directory, "
                        "removed when the run succeeds")


def parse_switch(text: str) -> tuple[int, Layout]:
    step, sep, layout = text.partition(":")
    if not sep or not step.strip().isdigit():
        raise ValueError(f"--switch {text!r} is not STEP:LAYOUT; write e.g. --switch 20:tp=2,pp=2")
    return int(step), Layout.parse(layout)


def parse_profile(text: str, steps: int) -> tuple[int, int]:
    """``--profile A:B``: steps A to B, inclusive, within [1, `steps`]."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"--profile {text!r} is not STEP:STEP; write e.g. --profile 5:7 (steps 5 to 7)")
    a, b = int(first), int(last)
    if a > b:
        raise ValueError(f"--profile {text}: step {a} comes after step {b}; write --profile {b}:{a}")
    if a < 1 or b > steps:
        raise ValueError(f"--profile {text}: the steps must lie in [1, --steps {steps}]")
    return a, b


def _profile(args: argparse.Namespace, steps: int) -> tuple[int, int, str] | None:
    """--profile's steps and where the traces go (--run-dir, else --metrics' directory); None without it."""
    if args.profile is None:
        return None
    first, last = parse_profile(args.profile, steps)
    if args.run_dir is None and args.metrics is None:
        raise ValueError(f"--profile {args.profile} writes a trace per rank into the run's directory: give --run-dir "
                         "DIR (or --metrics FILE: the traces go beside it)")
    return first, last, args.run_dir or str(Path(args.metrics).parent)


def _train_parser() -> argparse.ArgumentParser:
    """A parser of `shardshift train`'s flags alone (the command's own is a subparser of `main`'s)."""
    parser = argparse.ArgumentParser(prog="shardshift train", add_help=False)
    add_train_arguments(parser)
    return parser


def apply_config(args: argparse.Namespace) -> None:
    """--config FILE: its keys set on `args` where the command line does not give their flags, and
    `args.argv`, what the ranks (and an elastic job's joiners) parse again, made the explicit flags
    of the result, so that no process but this one reads the file (a joiner's host need not have
    it). ValueError naming --config FILE and the key."""
    if args.config is None:
        return
    keys = flag_keys(_train_parser())
    values = read_config(args.config, keys)
    given = given_keys(_train_parser(), args.argv[1:])  # argv[0] is "train"
    for key, value in values.items():
        if key not in given:
            setattr(args, key, value)
    args.argv = ["train", *keys_argv({key: getattr(args, key) for key, spec in keys.items()
                                      if getattr(args, key) != spec.default})]


def effective_config(args: argparse.Namespace) -> str:
    """Every flag's value in `args` as a --config file (TOML)."""
    keys = flag_keys(_train_parser())
    return to_toml({key: getattr(args, key) for key in keys}, keys,
                   "The effective configuration of `shardshift train` (docs/config.md); "
                   "`shardshift train --config FILE` reads it back.")


def _write_config(args: argparse.Namespace) -> None:
    """The effective configuration as --run-dir's config.toml (nothing without --run-dir)."""
    if args.run_dir is not None:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.run_dir) / "config.toml").write_text(effective_config(args))


def _switches(args: argparse.Namespace, layout: Layout) -> tuple[tuple[int, Layout], ...]:
    """The --switch flags; without any, the default run's switches when the job is the default one
    (no --layout, and the default layout's world: `layout` is what the run resolved)."""
    if args.switch is not None:
        return tuple(parse_switch(text) for text in args.switch)
    if args.layout is not None or layout != DEFAULT_LAYOUT or getattr(args, "elastic", False):
        return ()
    steps = [max(2, round(fraction * args.steps) + 1) for fraction, _ in DEFAULT_SWITCHES]
    return tuple(
        (step, layout) for step, (_, layout) in zip(steps, DEFAULT_SWITCHES) if step <= args.steps
    ) if len(set(steps)) == len(steps) else ()


def config_from_args(args: argparse.Namespace, layout: Layout):
    """Build and validate the run's configuration; raises ValueError with what to change."""
    from shardshift.data.corpus import vocabulary
    from shardshift.models import model_spec
    from shardshift.plots.canvas import can_draw
    from shardshift.train.config import OptimConfig, TrainConfig
    from shardshift.units import parse_size

    optim = OptimConfig(lr=args.lr, warmup_steps=args.warmup, grad_clip=args.grad_clip)
    return TrainConfig(
        layout=layout,
        model=model_spec(args.model, vocabulary(args.data)),
        steps=args.steps,
        stop_at=args.stop_at,
        seed=args.seed,
        dtype=args.dtype,
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        activation_checkpointing=args.activation_checkpointing,
        mixed_precision=args.mixed_precision,
        compile=args.compile,
        optim=optim,
        data=args.data,
        save=args.save or (str(Path(args.run_dir) / "checkpoints") if args.run_dir else None),
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        metrics=args.metrics or (str(Path(args.run_dir) / "metrics.jsonl") if args.run_dir else None),
        tensorboard=args.tensorboard,
        log_every=args.log_every,
        switches=_switches(args, layout),
        switch_budget=parse_size(args.switch_budget, "--switch-budget"),
        collectives=args.collectives,
        topology=args.topology,
        topology_by_host=bool(args.elastic),
        plot=args.plot or (args.run_dir is not None and can_draw()),
    )


def _check_before_launch(cfg, log_dir: str | None) -> None:
    """What the workers would refuse, refused before they start (they check again: under torchrun
    nothing runs before them)."""
    from shardshift.console import ProgressLine
    from shardshift.data.corpus import open_corpus, verify_corpus
    from shardshift.data.stream import BatchStream
    from shardshift.train.catalog import RunIdentity, check_save_dir, choose

    for flag, value in (("--save", cfg.save), ("--log-dir", log_dir), ("--tensorboard", cfg.tensorboard)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{flag} {value}: a file is in the way; give a directory")
    if cfg.plot:
        from shardshift.plots.canvas import check_drawable

        check_drawable(Path(cfg.picture), "--plot")
    if cfg.metrics is not None:
        metrics = Path(cfg.metrics)
        if metrics.is_dir() or not metrics.parent.is_dir():
            raise ValueError(f"--metrics {cfg.metrics}: " + ("is a directory; give a file in it" if metrics.is_dir()
                             else f"no directory {metrics.parent}; create it or give another path"))
    corpus = open_corpus(cfg.data)
    corpus.check_vocabulary(cfg.model.name, cfg.model.vocab_size)
    if cfg.eval_every and corpus.val is None:
        raise ValueError(f"--eval-every needs a held-out split: --data {cfg.data or '(the shipped corpus)'} has none; "
                         "prepare the data with `shardshift data prepare --val-fraction F` and train on that directory")
    streams = [("its train split", corpus.train)] + ([("its held-out split", corpus.val)] if cfg.eval_every else [])
    for what, tokens in streams if corpus.prepared else [("the text", corpus.train)]:
        try:
            BatchStream(tokens, cfg.model.seq_len, cfg.global_batch, cfg.seed, what, "tokens" if corpus.prepared
                        else "bytes")
        except ValueError as err:
            raise ValueError(f"--data {cfg.data or '(the shipped corpus)'}: {err}") from None
    with ProgressLine(0, name="checking the data's digests") as line:
        verify_corpus(corpus, line.update)
    if cfg.save:
        check_save_dir(cfg.save, cfg.resume_from)
    if cfg.resume:
        choose(cfg.resume_from, RunIdentity.of(cfg, corpus.digest), missing_ok=cfg.resume == "auto")
    if cfg.tensorboard is not None:
        try:
            Path(cfg.tensorboard).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--tensorboard {cfg.tensorboard}: cannot create the directory ({err.strerror}); give "
                             "another") from None


def _world_size(args: argparse.Namespace) -> int | None:
    """Processes of the job: set by the launcher (torchrun or ours) in a worker, else --nproc."""
    if in_worker():
        world = process_from_env().world_size
        if args.nproc is not None and args.nproc != world:
            raise ValueError(f"--nproc {args.nproc} differs from WORLD_SIZE={world} set by the launcher")
        return world
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    return args.nproc


def _layout(args: argparse.Namespace, nproc: int | None) -> Layout:
    if args.layout is not None:
        return Layout.parse(args.layout)
    if nproc is None or nproc == DEFAULT_LAYOUT.world_size:
        return DEFAULT_LAYOUT
    return Layout(dp=nproc)


def elastic_from_args(args: argparse.Namespace, nproc: int):
    """The elastic part of the command line, validated (every world size must have a layout)."""
    from shardshift.elastic.config import ElasticConfig, Inject, parse_address, parse_layout_for

    if args.switch is not None:
        raise ValueError("--switch does not go with --elastic: there the layout follows the world (--layout-for)")
    if args.coordinator is not None:
        parse_address(args.coordinator)
    injects = tuple(Inject.parse(text) for text in args.inject)
    joiners = sum(i.count for i in injects if i.kind == "join")
    ecfg = ElasticConfig(min_nproc=args.min_nproc, max_nproc=args.max_nproc or nproc + joiners,
                         layouts=tuple(parse_layout_for(text) for text in args.layout_for), injects=injects,
                         coordinator=args.coordinator, heartbeat_s=args.heartbeat_timeout,
                         redundancy=args.redundancy, memory_per_worker=_memory_per_worker(args, nproc + joiners))
    if not ecfg.min_nproc <= nproc <= ecfg.max_nproc:
        raise ValueError(f"--nproc {nproc} is outside --min-nproc {ecfg.min_nproc} .. --max-nproc {ecfg.max_nproc}")
    return ecfg


def _memory_per_worker(args: argparse.Namespace, default_max: int) -> int:
    """--memory-per-worker in bytes; by default this machine's memory divided by --max-nproc (an
    elastic job runs on the CPU). The launcher resolves the default once and passes it on (`_elastic_run`), so that
    every worker, on any host, sees the same limit."""
    from shardshift.units import parse_size

    if args.memory_per_worker is not None:
        return parse_size(args.memory_per_worker, "--memory-per-worker")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (args.max_nproc or default_max)


def _elastic_layout(args: argparse.Namespace, nproc: int, ecfg, cfg) -> Layout:
    """The first world's layout: --layout, or the one --layout-for or the layout policy gives `nproc`."""
    if args.layout is not None:
        return Layout.parse(args.layout)
    from shardshift.elastic.config import layout_for

    return layout_for(nproc, ecfg, cfg)


def elastic_job(args: argparse.Namespace):
    """The elastic run the command line asks for: (first world's size, its configuration under the
    first world's layout, the elastic configuration), validated: every world size from
    --min-nproc to --max-nproc must have a layout. ValueError says what to change."""
    from shardshift.elastic.config import check_every_world

    nproc = _world_size(args)
    if nproc is None:
        raise ValueError("--elastic needs --nproc: the first world's number of workers")
    ecfg = elastic_from_args(args, nproc)
    run = config_from_args(args, Layout())  # the run, before its first world's layout is chosen
    layout = _elastic_layout(args, nproc, ecfg, run)
    layout.check_world(nproc)
    check_every_world(ecfg, run)  # it refuses a layout the model or the batch cannot take
    return nproc, run.with_layout(layout), ecfg


def _elastic_run(args: argparse.Namespace) -> int:
    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
        if args.profile is not None:
            raise ValueError("--profile traces the steps of a fixed run: leave it out under --elastic")
        if args.device == "cuda":
            raise ValueError("--elastic runs on the CPU with gloo in this build (the state moves between worlds over "
                             "gloo groups of CPU tensors): leave --device out or pass --device cpu")
        from shardshift.elastic.membership import COORDINATOR_ENV

        if in_worker() and COORDINATOR_ENV not in os.environ:
            raise ValueError("--elastic does not run under torchrun (or another launcher): its own coordinator forms "
                             "each world. Run `shardshift train --elastic --nproc K ...` on one host, then `shardshift "
                             "join --coordinator HOST:PORT` (the address it prints) on each other host")
        nproc, cfg, ecfg = elastic_job(args)
        if not in_worker():
            _check_before_launch(cfg, args.log_dir)
            if cfg.collectives == "trees":  # the first world's workers run here: this host must be named
                from shardshift.collectives.topology.spec import hosts_topology
                from shardshift.elastic.config import parse_address
                from shardshift.elastic.protocol import host_of_this_process

                host, port = parse_address(args.coordinator) if args.coordinator else ("127.0.0.1", 1)
                hosts_topology(cfg.topology, [host_of_this_process(host, port)], "--topology")
            _write_config(args)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if in_worker():
        from shardshift.elastic.worker import member_main

        return member_main(cfg, ecfg, args.timeout)
    from shardshift.elastic.coordinator import launch_elastic

    argv = list(args.argv)
    if args.memory_per_worker is None:  # resolved here, once: every worker, on any host, sees the same
        argv += ["--memory-per-worker", str(ecfg.memory_per_worker)]
    # The model by its absolute name (a file's or a directory's path resolved): a joiner started in
    # another directory builds the same one. The last --model given wins.
    argv += ["--model", cfg.model.name]
    return launch_elastic(nproc, argv, ecfg, timeout_s=args.timeout, log_dir=args.log_dir)


def run(args: argparse.Namespace) -> int:
    try:
        apply_config(args)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(effective_config(args))
        return 0
    if args.elastic:
        return _elastic_run(args)
    given = [flag for flag, value in (("--inject", args.inject), ("--layout-for", args.layout_for),
                                      ("--coordinator", args.coordinator), ("--max-nproc", args.max_nproc),
                                      ("--min-nproc", args.min_nproc != 1),
                                      ("--heartbeat-timeout", args.heartbeat_timeout != 5.0),
                                      ("--redundancy", args.redundancy),
                                      ("--memory-per-worker", args.memory_per_worker)) if value]
    if given:
        print(f"shardshift: error: {given[0]} needs --elastic", file=sys.stderr)
        return 2
    argv = list(args.argv)
    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
        nproc = _world_size(args)
        layout = _layout(args, nproc)
        nproc = layout.world_size if nproc is None else nproc
        layout.check_world(nproc)
        if not in_worker() and args.run_dir is None and _is_default_job(args, layout):
            args.run_dir = _new_run_dir()  # the workers are told where it is
            argv += ["--run-dir", args.run_dir]
        cfg = config_from_args(args, layout)  # also checks every --switch layout against the job
        profile = _profile(args, cfg.steps)
        if not in_worker():
            if args.run_dir is not None:
                if Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
                    raise ValueError(f"--run-dir {args.run_dir}: a file is in the way; give a directory")
                Path(args.run_dir).mkdir(parents=True, exist_ok=True)
            _check_before_launch(cfg, args.log_dir)
            if args.device == "cuda":  # a GPU per rank, or the error says what to do (it needs torch: last)
                resolve_device("cuda", nproc)
            _write_config(args)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if in_worker():
        from shardshift.train.loop import ProfileSteps
        from shardshift.train.run import worker_main

        return worker_main(cfg, args.timeout, profile=None if profile is None else ProfileSteps(*profile))
    from shardshift.launch import launch

    if args.run_dir is not None:
        print(f"this run's outputs go to {args.run_dir}/", flush=True)
    code = launch(nproc, argv, preload=("shardshift.train.run",), log_dir=args.log_dir)
    if code == 0 and args.run_dir is not None:
        _after_run_dir(cfg)
    return code


def _is_default_job(args: argparse.Namespace, layout: Layout) -> bool:
    """`shardshift train` as the README's first command runs it: the default layout and switches,
    and nothing said of where its outputs go."""
    outputs = (args.metrics, args.tensorboard, args.save, args.resume, args.save_every, args.keep_checkpoints,
               args.plot)
    return args.layout is None and args.switch is None and layout == DEFAULT_LAYOUT and not any(outputs)


def _new_run_dir() -> str:
    import time

    base = Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return str(path)


def _after_run_dir(cfg) -> None:
    """What a run with --run-dir left, said, and a short sample of text from its last checkpoint."""
    from shardshift.cli.sample import DEFAULT_PROMPT
    from shardshift.train.sample import sample

    out = sample(cfg.save, DEFAULT_PROMPT, tokens=200, seed=0)
    from shardshift.plots.canvas import INSTALL

    picture = cfg.picture or f"none (matplotlib is not installed: {INSTALL})"
    print(f"metrics: {cfg.metrics}\npicture: {picture}\ncheckpoint: {out.checkpoint}\n"
          f"text from the trained model (again: shardshift sample --resume {cfg.save}):\n\n{out.prompt}{out.text}\n",
          flush=True)
